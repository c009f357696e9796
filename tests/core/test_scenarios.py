"""Named workloads through the real scheduler and a validating fake executor, per model kind and policy.

Block size 4. Every step runs check_integrity, and the executor asserts that every state it reads is
the state after exactly the tokens the request has computed (no poisoned checkpoint, no wrong copy).
"""

from __future__ import annotations

import pytest

from recap.core.request import Request
from tests.core.helpers import KINDS, POLICIES, Harness, make_scheduler, req


def cases(expected: dict[tuple[str, str], object]) -> list[tuple[str, str, object]]:
    """Every (kind, policy) pair; attention-only models ignore the policy (key ("attention", "*"))."""
    out = []
    for kind in KINDS:
        for policy in POLICIES:
            key = ("attention", "*") if kind == "attention" else (kind, policy)
            out.append((kind, policy, expected[key]))
    return out


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


# -- (a) multi-turn chat -------------------------------------------------------------------------
# Turn 1: 22-token prompt, 9 outputs (30 computed). Turn 2: history + 7 new tokens (38), 9 outputs
# (46 computed). Turn 3: history + 7 new. Prompt ends: 20, 36. Decode ends: 28, 44.
CHAT = {
    ("attention", "*"): (28, 44),
    ("hybrid", "none"): (0, 0),
    ("hybrid", "align"): (20, 36),
    ("hybrid", "all"): (28, 44),
    ("hybrid", "recap"): (28, 44),
    ("ssm", "none"): (0, 0),
    ("ssm", "align"): (20, 36),
    ("ssm", "all"): (28, 44),
    ("ssm", "recap"): (28, 44),
}


@pytest.mark.parametrize(("kind", "policy", "expected"), cases(CHAT))
def test_multi_turn_chat(kind: str, policy: str, expected: tuple[int, int]) -> None:
    h = Harness(make_scheduler(kind, policy))
    history = tokens(1000, 22)
    hits = []
    for turn in range(3):
        forced = tokens(5000 + 100 * turn, 9)
        r = h.run_one(req(f"t{turn}", history, max_tokens=9), forced=forced)
        assert r.output_token_ids == forced
        hits.append(r.num_cached_tokens)
        history = history + forced + tokens(3000 + 100 * turn, 7)
    assert hits[0] == 0
    assert tuple(hits[1:]) == expected
    if policy != "none" or kind == "attention":
        assert hits[1] >= 20 and hits[2] >= 36  # at least the previous turn's prompt end


def test_multi_turn_chat_when_history_differs_falls_back_to_prompt_end() -> None:
    h = Harness(make_scheduler("hybrid", "recap"))
    p1 = tokens(1000, 22)
    h.run_one(req("t0", p1, max_tokens=9), forced=tokens(5000, 9))
    # The client edited the reply: the history matches only up to the prompt.
    t1 = h.run_one(req("t1", p1 + tokens(7000, 9) + tokens(3000, 7), max_tokens=2))
    assert t1.num_cached_tokens == 20


# -- (b) one system prompt, different questions ----------------------------------------------------
SYSTEM = tokens(2000, 18)  # segment end 18 -> checkpoint at 16; the questions start inside block 4
SYS_HINT = {  # second request, segment boundary given
    ("attention", "*"): 16,
    **{(k, "none"): 0 for k in ("hybrid", "ssm")},
    **{(k, "align"): 0 for k in ("hybrid", "ssm")},
    **{(k, "all"): 16 for k in ("hybrid", "ssm")},
    **{(k, "recap"): 16 for k in ("hybrid", "ssm")},
}
SYS_LEARN = {  # three requests, no hint
    ("attention", "*"): (0, 16, 16),
    **{(k, "none"): (0, 0, 0) for k in ("hybrid", "ssm")},
    **{(k, "align"): (0, 0, 0) for k in ("hybrid", "ssm")},
    **{(k, "all"): (0, 16, 16) for k in ("hybrid", "ssm")},
    ("hybrid", "recap"): (0, 0, 16),  # the 2nd learns the branch point at its KV-hit end
    ("ssm", "recap"): (0, 0, 16),
}


@pytest.mark.parametrize(("kind", "policy", "expected"), cases(SYS_HINT))
def test_system_prompt_with_segment_boundary(kind: str, policy: str, expected: int) -> None:
    h = Harness(make_scheduler(kind, policy))
    h.run_one(req("q1", SYSTEM + tokens(100, 8), segments=(18,)))
    r = h.run_one(req("q2", SYSTEM + tokens(200, 8), segments=(18,)))
    assert r.num_cached_tokens == expected


@pytest.mark.parametrize(("kind", "policy", "expected"), cases(SYS_LEARN))
def test_system_prompt_learned_branch_point(kind: str, policy: str, expected: tuple[int, int, int]) -> None:
    h = Harness(make_scheduler(kind, policy))
    hits = tuple(h.run_one(req(f"q{i}", SYSTEM + tokens(100 * (i + 1), 8))).num_cached_tokens for i in range(3))
    assert hits == expected
    if (kind, policy) == ("hybrid", "recap"):
        assert h.sched.stats.num_branch_points == 1
        assert h.sched.stats.checkpoint_miss_tokens == 16  # q2 matched 16 KV tokens past its best checkpoint


def test_branch_point_learned_after_kv_evicted_the_shared_prefix() -> None:
    # A 16-usable-block KV pool: one-off traffic evicts the first request's document. The second
    # request recomputes it (no KV hit) but its chain matches hashes the pool remembers as evicted:
    # it checkpoints where it leaves them, and the third request hits there.
    h = Harness(make_scheduler("hybrid", "recap", num_kv_blocks=17))
    doc = tokens(6000, 18)
    h.run_one(req("a", doc + tokens(100, 6)))
    for i in range(3):
        h.run_one(req(f"one-off{i}", tokens(8000 + 1000 * i, 40)))
    b = h.run_one(req("b", doc + tokens(200, 6)))
    c = h.run_one(req("c", doc + tokens(300, 6)))
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 16)
    assert h.sched.stats.num_branch_points == 1  # b's, at 16
    assert h.sched.stats.checkpoint_miss_tokens == 0  # c's hit is all its KV prefix


# -- (c) incremental insert -------------------------------------------------------------------------
X, Y, Z = tokens(4000, 22), tokens(4100, 40), tokens(4200, 6)
INSERT = {
    ("attention", "*"): 20,
    **{(k, "none"): 0 for k in ("hybrid", "ssm")},
    **{(k, "align"): 0 for k in ("hybrid", "ssm")},
    **{(k, "all"): 20 for k in ("hybrid", "ssm")},
    **{(k, "recap"): 20 for k in ("hybrid", "ssm")},  # the block before the insertion point (22)
}


@pytest.mark.parametrize(("kind", "policy", "expected"), cases(INSERT))
def test_incremental_insert(kind: str, policy: str, expected: int) -> None:
    h = Harness(make_scheduler(kind, policy))
    h.run_one(req("a", X + Y, segments=(22,)))
    b = h.run_one(req("b", X + Z + Y, segments=(22, 28)))
    assert b.num_cached_tokens == expected


@pytest.mark.parametrize("kind", ["hybrid", "ssm"])
def test_incremental_insert_geometric_without_hints(kind: str) -> None:
    h = Harness(make_scheduler(kind, "recap", checkpoint_geometric=True))
    h.run_one(req("a", X + Y))
    b = h.run_one(req("b", X + Z + Y))
    assert b.num_cached_tokens == 16  # geometric 4, 8, 16, 32: at least half of the shared 22


# -- (d) identical prompt twice ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "policy", "expected"),
    cases(
        {
            ("attention", "*"): 20,
            **{(k, p): (0 if p == "none" else 20) for k in ("hybrid", "ssm") for p in POLICIES},
        }
    ),
)
@pytest.mark.parametrize("length", [22, 24])
def test_identical_prompt_twice(kind: str, policy: str, expected: int, length: int) -> None:
    h = Harness(make_scheduler(kind, policy))
    h.run_one(req("a", tokens(0, length), max_tokens=1))
    b = h.run_one(req("b", tokens(0, length), max_tokens=1))
    assert b.num_cached_tokens == expected  # all but the last block (24: the last token must be computed)


# -- (e) fragmented first chunk, then a chunk crossing a block boundary -------------------------------
@pytest.mark.parametrize("kind", ["hybrid", "ssm"])
@pytest.mark.parametrize("policy", ["all", "recap"])
def test_fragmented_chunk_never_publishes_early(kind: str, policy: str) -> None:
    h = Harness(make_scheduler(kind, policy, max_num_batched_tokens=3))
    a = h.add(req("a", tokens(0, 22), max_tokens=1, segments=(5,)))  # recap: segment end 5 -> 4
    pool = h.sched.cache.state.pool  # type: ignore[union-attr]
    out = h.sched.schedule()
    assert out.scheduled[0].checkpoints == []  # (0, 3] holds no boundary
    h.sched.update_from_output(out, h.executor.execute(out))
    out = h.sched.schedule()
    assert [c.position for c in out.scheduled[0].checkpoints] == [4]  # (3, 6] crosses 4
    assert pool.lookup(a.block_hashes[0]) is None  # planned, written this step: not findable yet
    h.sched.check_integrity()
    h.sched.update_from_output(out, h.executor.execute(out))
    assert pool.lookup(a.block_hashes[0]) is not None
    h.run()
    b = h.run_one(req("b", tokens(0, 6), max_tokens=2))
    assert b.num_cached_tokens == 4  # and the executor checked the copied state is state@4


def test_unreported_write_is_never_registered() -> None:
    h = Harness(make_scheduler("hybrid", "all", max_num_batched_tokens=3))
    a = h.add(req("a", tokens(0, 9), max_tokens=1))
    out = h.sched.schedule()
    h.sched.update_from_output(out, h.executor.execute(out))
    out = h.sched.schedule()
    result = h.executor.execute(out)
    result.written_checkpoints.clear()  # the kernel wrote nothing
    h.sched.update_from_output(out, result)
    h.sched.check_integrity()
    assert h.sched.cache.state.pool.lookup(a.block_hashes[0]) is None  # type: ignore[union-attr]


# -- (f) a preempted request resumes from its own checkpoints ------------------------------------------
@pytest.mark.parametrize(
    ("kind", "policy"),
    [("hybrid", "recap"), ("hybrid", "align"), ("hybrid", "none"), ("attention", "recap"), ("ssm", "recap")],
)
def test_preempted_request_resumes_from_its_checkpoints(kind: str, policy: str) -> None:
    # 12 usable KV blocks of 4 tokens; two requests that together outgrow them while decoding.
    h = Harness(make_scheduler(kind, policy, num_kv_blocks=13, num_state_slots=8))
    one = h.add(req("one", tokens(0, 17), max_tokens=14))
    two = h.add(req("two", tokens(100, 17), max_tokens=14))
    h.run()
    reference = Harness(make_scheduler(kind, policy))
    alone = reference.run_one(req("two", tokens(100, 17), max_tokens=14))
    assert two.output_token_ids == alone.output_token_ids and len(one.output_token_ids) == 14
    s = h.sched.stats
    if kind == "ssm":
        assert s.preemptions == 0  # no KV pool to run out of
        return
    assert s.preemptions >= 1 and two.num_preemptions >= 1
    if policy == "none" and kind == "hybrid":
        assert s.num_resumed_hit_tokens == 0
    else:
        assert s.num_resumed_hit_tokens >= 16  # at least its prompt end


def test_preempted_request_keeps_its_decode_snapshot() -> None:
    # 12 usable blocks. "two" (26-token prompt, prompt end 24) reaches 28 tokens at step 3 (a decode-end
    # snapshot), takes its 8th block for position 28 at step 4; at step 5 "one" needs its 5th block and
    # preempts it. Two's partial 8th block is the free one "one" takes; its 7 full blocks and the
    # snapshot survive, and "one" finishes before it needs another block.
    h = Harness(make_scheduler("hybrid", "recap", num_kv_blocks=13, num_state_slots=8))
    h.add(req("one", tokens(0, 13), max_tokens=7))
    two = h.add(req("two", tokens(100, 26), max_tokens=14))
    h.run()
    assert two.num_preemptions == 1
    assert h.sched.stats.num_resumed_hit_tokens == 28  # past its prompt end: the decode snapshot


def test_salts_are_isolated() -> None:
    h = Harness(make_scheduler("hybrid", "recap"))
    h.run_one(req("a", tokens(0, 22), salt="tenant-a"))
    assert h.run_one(req("b", tokens(0, 22), salt="tenant-b")).num_cached_tokens == 0
    assert h.run_one(req("c", tokens(0, 22))).num_cached_tokens == 0
    assert h.run_one(req("d", tokens(0, 22), salt="tenant-a")).num_cached_tokens == 20


def test_extra_keys_are_isolated() -> None:
    h = Harness(make_scheduler("attention"))
    h.run_one(Request("a", tokens(0, 22), 2, extra_keys=("lora-1",)))
    assert h.run_one(Request("b", tokens(0, 22), 2, extra_keys=("lora-2",))).num_cached_tokens == 0
    assert h.run_one(Request("c", tokens(0, 22), 2, extra_keys=("lora-1",))).num_cached_tokens == 20
