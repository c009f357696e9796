"""A seeded hypothesis run of random workloads through the real engine on a 2-layer hybrid, on an LFM3-shaped
model (short convs, a full and a sliding-window attention layer, window 10 < block 16 < prefixes) and on a
Kimi-Linear-shaped one (KDA + MLA + MoE) and on a GLM-5.3-Flash-shaped one (KDA + indexed MLA with a shared
selection + hyper-connections + MoE; top-k 8 tokens, so prompts past 12 tokens attend sparsely).

Random shared prefixes, segment boundaries, chunk budgets, policies, tiny pools and aborts; after
every step the core's integrity check runs (check_integrity=True), and every request that was not
aborted must answer exactly as it does alone with caching off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recap import SamplingParams
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import rnd

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
_ALONE: dict[tuple[int, ...], object] = {}


@pytest.fixture(scope="module")
def hybrid2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("h2"), "bamba", num_hidden_layers=2, attn_layer_indices=[1])


@pytest.fixture(scope="module")
def lfm3_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kinds = ["conv", "sliding_attention", "full_attention", "conv"]
    return tiny_model_dir(tmp_path_factory.mktemp("lfm3w"), "lfm3", layer_types=kinds, sliding_window=10)


@pytest.fixture(scope="module")
def kimi2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(
        tmp_path_factory.mktemp("kimi2"), "kimi_linear", num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def glm5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(
        tmp_path_factory.mktemp("glm5"), "glm5_next",
        text_config={"num_hidden_layers": 3, "layer_types": ["linear_attention", "indexed_attention",
                                                             "indexed_attention"],
                     "indexer_types": ["full", "full", "shared"], "mlp_layer_types": ["dense", "sparse", "sparse"]},
    )  # fmt: skip


def _alone(path: Path, prompt: list[int]) -> object:
    key = (str(path), *prompt)
    if key not in _ALONE:
        _ALONE[key] = make_llm(path, caching=False, max_model_len=256).generate([prompt], PARAMS)[0]
    return _ALONE[key]


request = st.tuples(
    st.integers(0, 2),  # which shared base
    st.integers(1, 70),  # prefix length taken from the base
    st.integers(0, 30),  # fresh suffix length
    st.booleans(),  # mark the prefix end as a segment boundary
    st.integers(0, 5),  # submit after this many steps
    st.sampled_from([None, None, None, 1, 3]),  # abort after this many steps (None: never)
)


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reqs=st.lists(request, min_size=2, max_size=7),
    policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([7, 16, 29, 64, 256]),
    tiny_pools=st.booleans(),
)
def test_random_workloads(hybrid2: Path, reqs: list, policy: str, budget: int, tiny_pools: bool) -> None:
    run_workload(hybrid2, reqs, policy, budget, tiny_pools)


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reqs=st.lists(request, min_size=2, max_size=6),
    policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([7, 16, 29, 256]),
    tiny_pools=st.booleans(),
)
def test_random_workloads_sliding_window(
    lfm3_window: Path, reqs: list, policy: str, budget: int, tiny_pools: bool
) -> None:
    """Blocks leave the window mid-request, hits need the window only; preemptions (tiny pools) and aborts."""
    run_workload(lfm3_window, reqs, policy, budget, tiny_pools)


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reqs=st.lists(request, min_size=2, max_size=6),
    policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([7, 29, 256]),
    tiny_pools=st.booleans(),
)
def test_random_workloads_kimi_linear(kimi2: Path, reqs: list, policy: str, budget: int, tiny_pools: bool) -> None:
    """KDA states checkpointed inside chunks, MLA latents in the KV blocks; preemptions and aborts."""
    run_workload(kimi2, reqs, policy, budget, tiny_pools)


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reqs=st.lists(request, min_size=2, max_size=6),
    policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([7, 29, 256]),
    tiny_pools=st.booleans(),
)
def test_random_workloads_glm5(glm5: Path, reqs: list, policy: str, budget: int, tiny_pools: bool) -> None:
    """The indexer's keys and gates restored with the latents on a hit; preemptions and aborts."""
    run_workload(glm5, reqs, policy, budget, tiny_pools)


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reqs=st.lists(request, min_size=2, max_size=7),
    policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([7, 16, 29, 256]),
    tiny_pools=st.booleans(),
)
def test_random_workloads_async_scheduling(hybrid2: Path, reqs: list, policy: str, budget: int,
                                           tiny_pools: bool) -> None:
    """The same workloads with the next step scheduled before the one in flight is updated (docs/gpu.md)."""
    run_workload(hybrid2, reqs, policy, budget, tiny_pools, async_scheduling=True)


def run_workload(path: Path, reqs: list, policy: str, budget: int, tiny_pools: bool,
                 async_scheduling: bool = False) -> None:  # fmt: skip
    kw: dict[str, object] = {"max_num_batched_tokens": budget, "max_model_len": 256,
                             "async_scheduling": async_scheduling}  # fmt: skip
    probe_bytes = 0
    if tiny_pools:
        runner = make_llm(path, caching=False, max_model_len=256).engine.runner
        probe_bytes = runner.state_bytes_per_slot
        attn_bytes = runner.kv_bytes_per_token + runner.window_bytes_per_token
        kw.update(kv_cache_bytes=18 * 16 * attn_bytes, state_cache_bytes=6 * probe_bytes, max_num_seqs=3)
    llm = make_llm(path, caching=True, policy=policy, **kw)
    eng = llm.engine
    bases = [rnd(500 + b, 70) for b in range(3)]
    plan = []
    for i, (b, plen, slen, mark, at, abort) in enumerate(reqs):
        prompt = bases[b][:plen] + rnd(600 + i, slen)
        plan.append((prompt, [plen] if mark else [], at, abort))
    ids: dict[int, str] = {}
    finished: dict[str, object] = {}
    step = 0
    while step < 500 and (len(ids) < len(plan) or eng.has_unfinished_requests()):
        for i, (prompt, bounds, at, abort) in enumerate(plan):
            if i not in ids and at <= step:
                ids[i] = eng.add_request(prompt, PARAMS, segment_boundaries=bounds)
            if i in ids and abort is not None and step == at + abort:
                eng.abort_request(ids[i])
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
        step += 1
    assert len(finished) == len(plan), "every request must finish (or be aborted) in bounded steps"
    for i, (prompt, _, _, _) in enumerate(plan):
        out = finished[ids[i]]
        if out.outputs[0].finish_reason == "abort":
            continue
        assert_same([out], [_alone(path, prompt)], f"request {i}")
    eng.scheduler.check_integrity()
