"""DESIGN invariant 1 on a Gated DeltaNet hybrid (Qwen3.5 layout: GDN + gated attention) and on RecurrentGemma
(RG-LRU states + sliding-window attention, window 12 < a block), every policy.

The scenarios users of these models hit: an incremental prompt that inserts content mid-prompt before a long
shared tail, a prompt shorter than one block sent twice, a prompt of exactly k blocks sent twice, four
requests sharing a system prompt admitted in the same step, and an abort mid-prefill followed by the same
prompt. Caching on must answer exactly as caching off, with the hits each policy promises.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from recap import LLM
from recap.engine.outputs import RequestOutput
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import GREEDY, drain, rnd

ARCHS = ["qwen3_5", "recurrent_gemma"]
POLICIES = ["none", "align", "all", "recap"]


@pytest.fixture(scope="module", params=ARCHS)
def gdn_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("gdn"), request.param)


def insert_before_long_tail(llm: LLM) -> list[RequestOutput]:
    """a (40, marked) + tail (200), then a + 10 inserted tokens + the same tail."""
    a, tail, x = rnd(90, 40), rnd(91, 200), rnd(92, 10)
    first = llm.generate([a + tail], GREEDY, segment_boundaries=[[40]])[0]
    return [first, llm.generate([a + x + tail], GREEDY)[0]]


def shorter_than_a_block_twice(llm: LLM) -> list[RequestOutput]:
    p = rnd(93, 11)
    return [llm.generate([p], GREEDY)[0] for _ in range(2)]


def exactly_three_blocks_twice(llm: LLM) -> list[RequestOutput]:
    p = rnd(94, 48)
    return [llm.generate([p], GREEDY)[0] for _ in range(2)]


def four_share_a_system_prompt_at_once(llm: LLM) -> list[RequestOutput]:
    """Four requests admitted in one step share a marked 40-token system prompt; a fifth comes later."""
    s = rnd(95, 40)
    prompts = [s + rnd(96 + i, 13 + 4 * i) for i in range(5)]
    first = llm.generate(prompts[:4], GREEDY, segment_boundaries=[[40]] * 4)
    return first + llm.generate(prompts[4:], GREEDY, segment_boundaries=[[40]])


SCENARIOS: dict[str, Callable[[LLM], list[RequestOutput]]] = {
    "insert": insert_before_long_tail,
    "short": shorter_than_a_block_twice,
    "k_blocks": exactly_three_blocks_twice,
    "four_at_once": four_share_a_system_prompt_at_once,
}
# num_cached_tokens per request and policy (block 16): the insert hits the block before the insertion (32)
# where the marked boundary or every block is checkpointed; 48 tokens sent again hit the prompt end (32);
# the four admitted together cannot hit one another (a checkpoint exists only after its step).
EXPECTED_HITS: dict[str, dict[str, list[int]]] = {
    "insert": {"none": [0, 0], "align": [0, 0], "all": [0, 32], "recap": [0, 32]},
    "short": {p: [0, 0] for p in POLICIES},
    "k_blocks": {"none": [0, 0], "align": [0, 32], "all": [0, 32], "recap": [0, 32]},
    "four_at_once": {"none": [0] * 5, "align": [0] * 5, "all": [0] * 4 + [32], "recap": [0] * 4 + [32]},
}
_REFERENCE: dict[tuple[Path, str], list[RequestOutput]] = {}


def _reference(path: Path, name: str) -> list[RequestOutput]:
    if (path, name) not in _REFERENCE:
        _REFERENCE[path, name] = SCENARIOS[name](make_llm(path, caching=False))
    return _REFERENCE[path, name]


@pytest.mark.parametrize("policy", POLICIES)
def test_gdn_caching_on_equals_off(gdn_path: Path, policy: str) -> None:
    for name, run in SCENARIOS.items():
        llm = make_llm(gdn_path, caching=True, policy=policy)
        got = run(llm)
        assert_same(got, _reference(gdn_path, name), f"{gdn_path.name}/{policy}/{name}")
        assert [o.num_cached_tokens for o in got] == EXPECTED_HITS[name][policy], f"{policy}/{name}"
        llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_gdn_abort_mid_prefill_then_same_prompt(gdn_path: Path, policy: str) -> None:
    long_p, other = rnd(97, 150), rnd(98, 40)
    alone = make_llm(gdn_path, caching=False)
    want_other, want_long = alone.generate([other], GREEDY)[0], alone.generate([long_p], GREEDY)[0]
    llm = make_llm(gdn_path, caching=True, policy=policy, max_num_batched_tokens=32)
    eng = llm.engine
    a, b = eng.add_request(long_p, GREEDY), eng.add_request(other, GREEDY)
    eng.step()
    eng.step()  # a is mid-prefill: 150 tokens at <= 32 per step
    eng.abort_request(a)
    outs = drain(eng)
    assert outs[a].outputs[0].finish_reason == "abort"
    assert_same([outs[b]], [want_other], f"{policy}/abort")
    eng.scheduler.check_integrity()
    again = llm.generate([long_p], GREEDY)[0]  # nothing past what the aborted prefill computed may be hit
    assert_same([again], [want_long], f"{policy}/after-abort")
    assert again.num_cached_tokens <= 64
