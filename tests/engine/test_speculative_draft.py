"""Speculative method "draft_model" (runner/draft_model.py): a draft model with the target's tokenizer proposes the
drafts. Greedy output equals the unspeculated run token for token (prefix caching on, chunked prefill, preemption,
abort, rows accepting different numbers of drafts); the draft's own state after each step is exactly the state of
its committed tokens; draft = target accepts every draft; a draft with another vocabulary is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap import LLM, SamplingParams
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.testing import make_tiny_checkpoint
from recap.model.trained_default import default_model_path, draft_model_path
from recap.runner.draft_model import DraftModelMismatchError, DraftPools, load_draft_runner
from tests.engine.conftest import tiny_model_dir
from tests.engine.workloads import drain, rnd

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TARGETS = ["mamba2", "qwen3_5", "bamba", "lfm2"]


def perturbed(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of `src` whose matrices carry N(0, scale * their std) noise: a draft that agrees with the target
    often but not always."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if t.dim() >= 2 and t.is_floating_point():
            weights[name] = t + torch.randn(t.shape, generator=g).to(t.dtype) * float(t.float().std()) * scale
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_draft")
    paths = {a: tiny_model_dir(root, a) for a in TARGETS}
    for a in TARGETS:
        paths[f"{a}-noisy"] = perturbed(paths[a], root / f"{a}-noisy", 0.05)
    other = make_tiny_checkpoint("mamba2", root / "other-vocab", vocab_size=300)
    from recap.model.default_model import save_tokenizer

    save_tokenizer(other, vocab_size=300)
    paths["other-vocab"] = other
    return paths


def spec(draft: Path | str, k: int = K, backoff: int = 0) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "max_draft_backoff": backoff}


def make(path: Path | str, speculative: dict[str, object] | None, caching: bool = True, **kw: object) -> LLM:
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 256, "check_integrity": True, "seed": 0,
                               "max_num_seqs": 8, "num_threads": 1, **kw}
    return LLM(str(path), enable_prefix_caching=caching, speculative_config=speculative, **opts)  # type: ignore[arg-type]


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _prompts() -> list[list[int]]:
    return [rnd(1, 7) * 5, rnd(2, 40), rnd(3, 11) * 3 + rnd(4, 5), rnd(5, 33)]


def reference(path: Path | str, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    llm = make(path, None, caching=False)
    return [tokens(llm, [p], params)[0] for p in prompts]


def draft_state_is_exact(llm: LLM) -> int:
    """For every running request, the draft's running slot (and its KV below its position) equals the draft model's
    state computed from scratch over the request's first `pos` committed tokens. Returns the requests checked."""
    eng = llm.engine
    drafter = eng.runner.drafter
    assert drafter is not None
    checked = 0
    for request in eng.scheduler.view.running:
        rid = request.request_id
        pos = drafter.position(rid)
        if not pos:
            continue
        seq = drafter._seqs[rid]
        ref = ModelCaches.allocate(drafter.config, num_kv_blocks=len(seq.blocks) + 1, block_size=16,
                                   num_state_slots=1, dtype=torch.float32)  # fmt: skip
        table = list(range(1, len(seq.blocks) + 1))
        row = SeqSpec(request.token_slice(0, pos), 0, table if drafter.has_kv else (), 0 if drafter.has_state else -1)
        batch = build_forward_batch([row], block_size=16, chunk_size=drafter.config.ssm_chunk_size,
                                    with_attention=drafter.has_kv, with_ssm=drafter.has_state)  # fmt: skip
        with torch.inference_mode():
            drafter.model(batch, ref)
        for x, y in zip(drafter.caches.state_tensors(), ref.state_tensors()):
            torch.testing.assert_close(x[seq.slot], y[0], rtol=1e-4, atol=1e-5)
        for i, kv in drafter.caches.kv.items():
            for name, t in kv.tensors.items():
                mine = torch.cat([t[b] for b in seq.blocks])[:pos]
                want = torch.cat([ref.kv[i].tensors[name][b] for b in table])[:pos]
                torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)
        checked += 1
    return checked


@pytest.mark.parametrize("arch", TARGETS)
def test_draft_model_equals_plain_greedy(models: dict[str, Path], arch: str) -> None:
    """Caching on, chunked prefill (24-token budget), a batch of four; the noisy draft accepts some drafts, not
    all; after every step the draft's state is that of its committed tokens."""
    prompts = _prompts()
    want = reference(models[arch], prompts)
    llm = make(models[arch], spec(models[f"{arch}-noisy"]), max_num_batched_tokens=24)
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    outs: dict[str, list[int]] = {}
    checked = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        checked += draft_state_is_exact(llm)
    assert [outs[r] for r in rids] == want
    s = eng.scheduler.stats.spec
    assert checked > 10 and s.num_drafts > 10
    per = s.accepted_per_position  # steps accepting none, some and all of their drafts
    assert s.num_drafts > per[0] > per[K - 1] > 0, f"the noisy draft was meant to be right sometimes: {s}"


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_draft_equal_to_target_accepts_everything(models: dict[str, Path], arch: str) -> None:
    """The bound: the target as its own draft; prefix caching on, and a repeated prompt that hits the target's
    cache (the draft computes the whole prefix itself)."""
    prompts = _prompts()
    want = reference(models[arch], prompts)
    llm = make(models[arch], spec(models[arch]), max_num_batched_tokens=24)
    assert tokens(llm, prompts) == want
    again = llm.generate(prompts[1:2], GREEDY)
    assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == want[1]
    s = llm.engine.scheduler.stats.spec
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_preemption_with_a_draft_model(models: dict[str, Path]) -> None:
    path = models["bamba"]
    probe = make(path, None, caching=False)
    block_bytes = probe.engine.runner.kv_bytes_per_token * 16
    prompts = [rnd(60 + i, 50 + 7 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = reference(path, prompts, params)
    llm = make(path, spec(models["bamba-noisy"]), kv_cache_bytes=12 * block_bytes, max_model_len=160,
               max_num_batched_tokens=64)  # fmt: skip
    assert tokens(llm, prompts, params) == want
    stats = llm.engine.scheduler.stats
    assert stats.preemptions > 0 and stats.spec.num_accepted_tokens > 0


def test_abort_returns_the_draft_state(models: dict[str, Path]) -> None:
    path = models["bamba"]
    a_prompt, b_prompt = rnd(70, 30), rnd(71, 19)
    want = reference(path, [a_prompt, b_prompt])
    llm = make(path, spec(models["bamba-noisy"]))
    eng = llm.engine
    drafter = eng.runner.drafter
    assert drafter is not None
    free = drafter.num_free_blocks
    a = eng.add_request(a_prompt, GREEDY)
    b = eng.add_request(b_prompt, GREEDY)
    for _ in range(4):
        eng.step()
    assert eng.scheduler.stats.spec.num_drafts > 0
    eng.abort_request(a)
    outs = drain(eng)
    assert outs[a].outputs[0].finish_reason == "abort" and outs[b].outputs[0].token_ids == want[1]
    assert tokens(llm, [a_prompt]) == [want[0]]
    eng.step()  # reports the last finish to the runner
    assert drafter.num_free_blocks == free and not drafter._seqs


def test_a_request_the_draft_cannot_hold_decodes_plainly(models: dict[str, Path]) -> None:
    """Draft pools of 2 KV blocks: the 40-token prompt never gets a draft, the others do; output unchanged."""
    path = models["bamba"]
    prompts = [rnd(2, 40), rnd(9, 5)]
    want = reference(path, prompts)
    llm = make(path, spec(path))
    tok = llm.get_tokenizer()
    llm.engine.runner.drafter = load_draft_runner(str(path), 512, tok, DraftPools(3, 2, 2 * (K - 1)), 16,
                                                  torch.float32)  # fmt: skip
    assert tokens(llm, prompts) == want
    s = llm.engine.scheduler.stats.spec
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_sampled_requests_with_a_draft_model(models: dict[str, Path]) -> None:
    """A seeded sampled request: verification of the (deterministic) drafts draws as the plain sampler does."""
    path = models["mamba2"]
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=3, ignore_eos=True)
    prompts = _prompts()[:2]
    want = reference(path, prompts, params)
    llm = make(path, spec(path))
    assert tokens(llm, prompts, params) == want
    assert llm.engine.scheduler.stats.spec.num_accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(DraftModelMismatchError, match="vocab_size"):
        make(models["mamba2"], spec(models["other-vocab"]))


def test_bad_draft_model_configs(models: dict[str, Path]) -> None:
    for bad in ({"method": "draft_model"}, {"method": "ngram", "model": str(models["mamba2"])},
                '{"method": "draft_model", "model": "x", "num_speculative_tokens": 0}'):  # fmt: skip
        with pytest.raises(ValueError, match="speculative"):
            LLM(str(models["mamba2"]), speculative_config=bad)  # type: ignore[arg-type]


def test_trained_default_with_its_draft() -> None:
    """The shipped default model with the shipped draft (same tokenizer), and with itself as draft (all accepted):
    greedy output equal to the plain run, prefix caching on, chunked prefill."""
    prompts = ["The President said that the Congress", "Call me Ishmael. Some years ago, never mind how long"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    target = default_model_path()
    base = LLM(str(target), num_threads=1, max_model_len=512, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    for draft in (draft_model_path(), target):
        llm = LLM(str(target), num_threads=1, max_model_len=512, check_integrity=True, max_num_batched_tokens=8,
                  speculative_config=spec(draft, k=4, backoff=64))  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, draft
        s = llm.engine.scheduler.stats.spec
        assert s.num_drafts > 0 and s.num_accepted_tokens > 0
        if draft == target:
            assert s.num_accepted_tokens == s.num_draft_tokens


@pytest.mark.parametrize(("arch", "draft"), [("bamba", "qwen3_5"), ("mamba2", "lfm2")])
def test_a_draft_of_another_family(models: dict[str, Path], arch: str, draft: str) -> None:
    """A draft whose state kinds differ from the target's (GDN or short conv drafting for Mamba2 hybrids): its
    state stays exact after every step, the output unchanged (random drafts are rarely accepted)."""
    prompts = _prompts()[:2]
    want = reference(models[arch], prompts)
    llm = make(models[arch], spec(models[draft]), max_num_batched_tokens=24)
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    outs: dict[str, list[int]] = {}
    checked = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        checked += draft_state_is_exact(llm)
    assert [outs[r] for r in rids] == want and checked > 10
    assert eng.scheduler.stats.spec.num_drafts > 10


def test_memory_plan_counts_the_draft(models: dict[str, Path]) -> None:
    runner = make(models["bamba"], spec(models["bamba-noisy"])).engine.runner
    assert runner.drafter is not None
    plan = runner.memory_plan()
    assert plan.draft_bytes == runner.drafter.total_bytes > runner.drafter.caches.total_bytes() > 0
    assert "draft model" in plan.describe()
    assert make(models["bamba"], None).engine.runner.memory_plan().draft_bytes == 0
