"""The whole engine on the Triton kernel set (kernels="triton"; on a CPU under Triton's interpreter).

The same scripts as the equivalence tests, on a Mamba2 hybrid, a Gated DeltaNet hybrid and a short-conv
hybrid (plus Mamba1 and KDA + MLA once each): the Triton backend gives the torch backend's greedy tokens, with
caching on or off, at any prefill split, under preemption and after an abort. The Qwen3.5 and LFM3 hybrids' attention
layers run the fused q/k preparation there (kernels/triton/rope_qk.py), which also stores their K/V in the paged
cache (the attention op's own write never runs), and every hybrid's residual norms take the residual add that
feeds them in the same launch (kernels/triton/add_rms_norm.py).

Under the interpreter these cost 25-190 s each on the 2-core CI box (760 s in all), so the default suite runs
the multiturn script on each hybrid and Mamba1; the other scripts, KDA, preemption and abort are `-m slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recap import LLM, SamplingParams
from recap.engine.outputs import RequestOutput
from recap.model.layers.norm import RMSNorm
from recap.model.layers.qk_rope import QKRope
from tests.engine.test_equivalence import assert_same
from tests.engine.workloads import GREEDY, SCRIPTS, drain, rnd

pytest.importorskip("triton")
from recap.kernels.triton.add_rms_norm import add_rms_norm  # noqa: E402
from recap.kernels.triton.rope_qk import rope_qk  # noqa: E402

HYBRIDS = ["nemotron_h", "qwen3_5", "lfm3"]
_TORCH: dict[tuple[str, str], list[RequestOutput]] = {}


def make_llm(path: Path, kernels: str, caching: bool = True, **kw: object) -> LLM:
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 256, "check_integrity": True, "seed": 0, **kw}
    return LLM(str(path), device="cpu", kernels=kernels, enable_prefix_caching=caching,  # type: ignore[arg-type]
               checkpoint_policy="all", **opts)  # fmt: skip


def torch_reference(path: Path, arch: str, script: str) -> list[RequestOutput]:
    if (arch, script) not in _TORCH:
        _TORCH[(arch, script)] = SCRIPTS[script](make_llm(path, "torch", caching=False))
    return _TORCH[(arch, script)]


def assert_fused_attention(llm: LLM, arch: str) -> None:
    """Every attention layer holds the kernel set's fused q/k preparation (the Qwen3.5 and LFM3 hybrids' layers
    run it; Nemotron-H's, with no RoPE or q/k norm, have nothing to fuse), every residual norm its fused add."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QKRope)]
    assert layers and all(m.rope_kernel is rope_qk for m in layers), arch
    norms = [m for m in llm.engine.runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.add_norm_kernel is add_rms_norm for m in norms), arch


def count_attention_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, one entry per K/V write the Triton attention op does itself (triton/paged_attention.py's
    write_kv: the layers whose rope_qk stores the K/V leave it out)."""
    from recap.kernels.triton import paged_attention as pa

    calls: list[int] = []
    write = pa.write_kv

    def counted(*args: object, **kw: object) -> None:
        calls.append(1)
        write(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pa, "write_kv", counted)
    return calls


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("arch", "script"),
    [pytest.param(a, s, marks=() if s == "multiturn" else _SLOW) for s in ("multiturn", "insert", "concurrent_mix")
     for a in HYBRIDS],
)  # fmt: skip
def test_triton_equals_torch_cached_and_chunked(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str, script: str
) -> None:
    """Cached = uncached on the Triton kernels, whole prompts or split into 24-token chunks; the Qwen3.5 and LFM3
    attention layers' K/V stored by rope_qk alone (Nemotron-H's, with nothing to prepare, by the attention op)."""
    path = tiny_models[arch]
    want = torch_reference(path, arch, script)
    writes = count_attention_writes(monkeypatch)
    llm = make_llm(path, "triton")
    assert_fused_attention(llm, arch)
    assert_same(SCRIPTS[script](llm), want, f"{arch}/{script}/triton")
    chunked = make_llm(path, "triton", max_num_batched_tokens=24)
    assert_same(SCRIPTS[script](chunked), want, f"{arch}/{script}/triton-chunked")
    assert (len(writes) == 0) == (arch != "nemotron_h"), f"{arch}: {len(writes)} K/V writes by the attention op"


@pytest.mark.parametrize("arch", ["mamba", pytest.param("kimi_linear", marks=_SLOW)])
def test_triton_equals_torch_other_kinds(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    assert_same(SCRIPTS["multiturn"](make_llm(path, "triton")), torch_reference(path, arch, "multiturn"), arch)


@_SLOW
def test_triton_preemption_and_abort(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["nemotron_h"]
    prompts = [rnd(60 + i, 40 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    alone = make_llm(path, "torch", caching=False)
    want = [alone.generate([p], params)[0] for p in prompts]
    block_bytes = alone.engine.runner.kv_bytes_per_token * 16
    llm = make_llm(path, "triton", kv_cache_bytes=10 * block_bytes, max_model_len=128, max_num_batched_tokens=48)
    assert_same(llm.generate(prompts, params), want, "nemotron_h/triton/preempted")
    assert llm.engine.scheduler.stats.preemptions > 0, "the pool was meant to force preemption"
    eng = llm.engine
    a, b = eng.add_request(rnd(70, 90), GREEDY), eng.add_request(prompts[0], GREEDY)
    eng.step()
    eng.abort_request(a)
    outs = drain(eng)
    assert outs[a].outputs[0].finish_reason == "abort"
    assert outs[b].outputs[0].token_ids == alone.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3_5", pytest.param("kimi_linear", marks=_SLOW)])
def test_long_prompts_take_the_chunk_form_and_their_checkpoints_serve_hits(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A prompt of CHUNK_MIN_TOKENS+ tokens runs the chunk-parallel gated delta rule (kernels/triton/gdn_chunk.py:
    GDN's decay per head on the Qwen3.5 hybrid, KDA's per key channel on Kimi-Linear); the checkpoints it writes
    inside that step serve later requests (their suffixes on the per-row walk), and every output equals the torch
    kernels' uncached run."""
    from recap.kernels.triton import gdn

    calls: list[int] = []  # the decay's dims: 2 per head (GDN), 3 per key channel (KDA)
    chunk_form = gdn.chunk_gated_delta_rule

    def counted(*args: object, **kw: object) -> object:
        calls.append(args[3].dim())  # type: ignore[attr-defined]
        return chunk_form(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", counted)
    path = tiny_models[arch]
    n = gdn.CHUNK_MIN_TOKENS + 21
    long = rnd(91, n)
    prompts = [long, long[: n - 37] + rnd(92, 19), long + rnd(93, 5)]  # a hit mid-prompt, a hit at its end

    def run(llm: LLM) -> list[RequestOutput]:
        params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
        return [llm.generate([p], params)[0] for p in prompts]

    want = run(make_llm(path, "torch", caching=False, max_model_len=512))
    llm = make_llm(path, "triton", max_model_len=512)
    got = run(llm)
    assert set(calls) == {3 if arch == "kimi_linear" else 2}, f"chunk form calls (decay dims): {calls}"
    assert [o.num_cached_tokens for o in got[1:]] == [n - 37 - (n - 37) % 16, n - n % 16]
    assert_same(got, want, f"{arch}/long/triton")
