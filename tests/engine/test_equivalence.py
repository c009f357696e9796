"""DESIGN invariant 1: prefix caching never changes what the model says.

For every architecture and policy, greedy outputs with caching on equal outputs with caching off
(identical tokens, logprobs within 1e-3), and num_cached_tokens is the hit the policy promises.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recap import LLM
from recap.engine.outputs import RequestOutput
from tests.engine.conftest import ARCHS, tiny_model_dir
from tests.engine.workloads import SCRIPTS, prompt_end

POLICIES = ["align", "all", "recap"]
_REFERENCE: dict[tuple[str, str], list[RequestOutput]] = {}

# Expected num_cached_tokens per script and policy (None: not asserted). Derived from DESIGN §1/§4 with
# block 16 and the lengths in workloads.py.
EXPECTED_HITS: dict[str, dict[str, list[int | None]]] = {
    # 45-token prompt, 6 outputs, +17 per turn: align hits the previous prompt end, recap its decode end.
    "multiturn": {"align": [0, 32, 64], "all": [0, 48, 64], "recap": [0, 48, 64]},
    "sysprompt_marked": {"align": [0, 0, 0], "all": [0, 32, 32], "recap": [0, 32, 32]},
    # Without a marked boundary, recap learns the branch point on the 2nd and hits on the 3rd.
    "sysprompt_unmarked": {"align": [0, 0, 0], "all": [0, 32, 32], "recap": [0, 0, 32]},
    "insert": {"align": [0, 0], "all": [0, 32], "recap": [0, 32]},
    "identical": {p: [None, None, None, prompt_end(53)] for p in POLICIES},
    # Decode end of a 80-token prompt lands at 80 (its first output token is computed).
    "shifted": {"align": [0, 0, 64, 64], "all": [0, 0, 80, 80], "recap": [0, 0, 80, 80]},
    "concurrent_mix": {},
}


def make_llm(path: Path, caching: bool, policy: str = "recap", **kw: object) -> LLM:
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 512, "check_integrity": True, "seed": 0, **kw}
    return LLM(str(path), enable_prefix_caching=caching, checkpoint_policy=policy, **opts)  # type: ignore[arg-type]


def reference(path: Path, arch: str, script: str) -> list[RequestOutput]:
    key = (arch, script)
    if key not in _REFERENCE:
        _REFERENCE[key] = SCRIPTS[script](make_llm(path, caching=False))
    return _REFERENCE[key]


def assert_same(got: list[RequestOutput], want: list[RequestOutput], where: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        gt, wt = g.outputs[0], w.outputs[0]
        assert g.prompt_token_ids == w.prompt_token_ids, f"{where} request {i}: prompts diverged"
        assert gt.token_ids == wt.token_ids, f"{where} request {i}: tokens differ"
        assert gt.logprobs is not None and wt.logprobs is not None
        for tok, a, b in zip(gt.token_ids, gt.logprobs, wt.logprobs):
            la, lb = a[tok].logprob, b[tok].logprob
            assert abs(la - lb) <= 1e-3, f"{where} request {i}: logprob {la} vs {lb}"


# Every architecture runs every script under the recap policy by default. The hits of align and all depend on
# blocks and the policy, not on the layer kinds (DESIGN §4), so by default they run on one architecture per kind
# of state (Mamba1, Mamba2 + KV, GDN, short conv + window, KDA + MLA, lightning, RG-LRU + local, RWKV, xLSTM;
# test_family_scenarios.py runs every policy on the newest families); the rest of the matrix is `-m slow`.
POLICY_ARCHS = ("mamba", "bamba", "qwen3_5", "lfm3", "kimi_linear", "minimax", "recurrent_gemma", "rwkv", "xlstm")
MATRIX = [pytest.param(policy, arch, marks=() if policy == "recap" or arch in POLICY_ARCHS else pytest.mark.slow)
          for policy in POLICIES for arch in ARCHS]  # fmt: skip


@pytest.mark.parametrize(("policy", "arch"), MATRIX)
def test_caching_on_equals_off(tiny_models: dict[str, Path], arch: str, policy: str) -> None:
    path = tiny_models[arch]
    for script, run in SCRIPTS.items():
        llm = make_llm(path, caching=True, policy=policy)
        got = run(llm)
        assert_same(got, reference(path, arch, script), f"{arch}/{policy}/{script}")
        for i, want in enumerate(EXPECTED_HITS[script].get(policy, [])):
            if want is not None:
                assert got[i].num_cached_tokens == want, (
                    f"{arch}/{policy}/{script} request {i}: cached {got[i].num_cached_tokens}, expected {want}"
                )


@pytest.mark.parametrize("arch", ARCHS)
def test_caching_off_reports_no_hits(tiny_models: dict[str, Path], arch: str) -> None:
    for script in ("multiturn", "identical"):
        assert all(o.num_cached_tokens == 0 for o in reference(tiny_models[arch], arch, script))


@pytest.mark.parametrize("arch", ["mamba", "bamba", "jamba", "falcon_h1", "zamba", "minimax", "recurrent_gemma",
                                  "rwkv", "xlstm", "zaya"])
@pytest.mark.parametrize("budget", [13, 19, 157])  # block_size - 3, + 3, 10 x block_size - 3
def test_odd_chunk_budgets(tiny_models: dict[str, Path], arch: str, budget: int) -> None:
    path = tiny_models[arch]
    for script in ("multiturn", "sysprompt_marked", "concurrent_mix"):
        llm = make_llm(path, caching=True, policy="recap", max_num_batched_tokens=budget)
        got = SCRIPTS[script](llm)
        assert_same(got, reference(path, arch, script), f"{arch}/budget {budget}/{script}")
        if script == "sysprompt_marked":
            assert [o.num_cached_tokens for o in got] == [0, 32, 32]


def test_a_captured_decode_step_keeps_caching_on_equal_to_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Granite-4.0-H without its MoE (as Granite-4.0-H-1B; its muP multipliers in the graph) decodes through the
    CPU backend's captured graph, and prefix caching still changes nothing."""
    from recap.backends.decode_graph import DecodeGraph
    from recap.kernels.decode_ops import decode_ops_available

    if not decode_ops_available():
        pytest.skip("no C compiler for the native decode ops")
    path = tiny_model_dir(tmp_path, "granite_hybrid", num_local_experts=0, num_experts_per_tok=0)
    replays: list[int] = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, b, c: (replays.append(1), real(self, b, c))[1])
    for script in ("multiturn", "concurrent_mix"):
        want = SCRIPTS[script](make_llm(path, caching=False))
        assert replays, f"{script}: no decode step replayed a graph"
        replays.clear()
        assert_same(SCRIPTS[script](make_llm(path, caching=True)), want, f"granite dense/{script}")
        assert replays, f"{script}: no cached decode step replayed a graph"
