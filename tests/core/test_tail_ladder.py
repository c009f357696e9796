"""The tail ladder: the gap-heap greedy equals the plain greedy, its first rung is the single tail, the size
rule maximizes its objective, and the policy writes rungs only where lower tiers hold them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.config import CacheConfig
from recap.core.output import PAD_SLOT_ID
from recap.core.policy import CheckpointPolicy, Position, Source
from recap.core.request import Request
from recap.core.state_manager import StateManager
from recap.core.state_pool import StatePool
from recap.core.tail_ladder import greedy_ladder, ladder_reference, ladder_size
from recap.core.tier_index import EntryKind
from tests.core.helpers import Harness, make_scheduler, req

BS = 4
distances_st = st.lists(st.integers(0, 40).map(lambda b: b * BS), max_size=40)


@settings(max_examples=300, deadline=None)
@given(distances=distances_st, end=st.integers(0, 48).map(lambda b: b * BS), max_rungs=st.integers(0, 12))
def test_the_gap_heap_greedy_equals_the_plain_greedy(distances: list[int], end: int, max_rungs: int) -> None:
    fast = greedy_ladder(distances, end, max_rungs)
    assert fast == ladder_reference(distances, end, max_rungs)
    rungs = [x for x, _ in fast]
    assert len(set(rungs)) == len(rungs) and all(0 <= x < end for x in rungs)
    assert all(gain > 0 for _, gain in fast)
    assert [g for _, g in fast] == sorted((g for _, g in fast), reverse=True)  # a greedy's gains never grow
    eligible = {d for d in distances if d < end}
    assert len(fast) == min(max_rungs, len(eligible))  # every distinct distance gains until all are rungs


@settings(max_examples=300, deadline=None)
@given(distances=distances_st, end=st.integers(1, 48).map(lambda b: b * BS))
def test_the_first_rung_is_the_single_tail(distances: list[int], end: int) -> None:
    """argmax over the recent distances d of F(d) (E - d), ties to the shorter: the first policy's tail."""
    ranked = sorted(distances)
    best, choice = -1, None
    for i, d in enumerate(ranked):
        if d >= end:
            break
        if (i + 1) * (end - d) > best:
            best, choice = (i + 1) * (end - d), d
    first = greedy_ladder(distances, end, 1)
    assert [x for x, _ in first] == ([] if choice is None else [choice])


@settings(max_examples=300, deadline=None)
@given(
    num_rungs=st.integers(0, 12),
    longest=st.integers(0, 500),
    capacity=st.integers(0, 5000),
    base=st.floats(0.0, 8.0),
)
def test_the_ladder_size_is_the_most_rungs_that_outlive_the_longest_reuse(
    num_rungs: int, longest: int, capacity: int, base: float
) -> None:
    m = ladder_size(num_rungs, longest, capacity, base)
    if num_rungs == 0:
        assert m == 0
        return
    assert 1 <= m <= num_rungs
    if longest == 0 or capacity == 0:
        assert m == 1
        return
    if m > 1:
        assert capacity / (base + m) >= longest  # every checkpoint outlives the longest recent reuse
    if m < num_rungs:
        assert capacity / (base + m + 1) < longest  # one more rung would not
    assert ladder_size(num_rungs, longest, capacity + 1000, base) >= m  # more capacity, never fewer rungs


def test_enough_capacity_writes_every_rung_and_none_writes_one() -> None:
    assert ladder_size(3, 20, capacity=10_000, base_writes=2) == 3
    assert ladder_size(3, 20, capacity=0, base_writes=2) == 1
    assert ladder_size(3, 0, capacity=10_000, base_writes=2) == 1  # no reuse seen: nothing to size by
    # 100 checkpoints over 2 + m writes a request, reuses up to 20 requests apart: 3 checkpoints a request
    assert ladder_size(3, 20, capacity=100, base_writes=2) == 3
    assert ladder_size(3, 25, capacity=100, base_writes=2) == 2
    assert ladder_size(3, 50, capacity=100, base_writes=2) == 1  # not even the base writes live that long


def _policy(tier_capacity: int) -> CheckpointPolicy:
    p = CheckpointPolicy(CacheConfig(block_size=BS, checkpoint_policy="recap"), has_state=True)
    p.tier_capacity = tier_capacity
    return p


def test_rungs_are_written_only_where_lower_tiers_hold_them() -> None:
    ladder = [(36, Source.TAIL), (44, Source.LADDER), (52, Source.LADDER)]
    for capacity, expect in [(0, ladder[:1]), (1000, ladder)]:
        p = _policy(capacity)
        for d, interval in [(20, 3)] * 4 + [(4, 2), (12, 5)]:
            p.observe_divergence(d, None, interval)
        r = Request("r", list(range(58)), 4)  # prompt end 56: rungs at 56 - 20, 56 - 12, 56 - 4
        p.admit(r, 0, 0)
        tails = [(s.position, s.source) for s in p.positions(r, 0, 58) if s.source in (Source.TAIL, Source.LADDER)]
        assert tails == expect
        assert p.num_ladder_rungs == len(expect) - 1


@settings(max_examples=100, deadline=None)
@given(
    observed=st.lists(st.tuples(st.integers(0, 30).map(lambda b: b * BS), st.integers(0, 50)), max_size=30),
    end=st.integers(1, 40).map(lambda b: b * BS),
    capacity=st.integers(0, 400),
)
def test_the_ladder_extends_the_single_tail(observed: list[tuple[int, int]], end: int, capacity: int) -> None:
    """Over any observations: the first rung is `tail_distance`, rungs are distinct block multiples below the
    end, and with no lower tier there is only the one."""
    p = _policy(capacity)
    for d, interval in observed:
        p.observe_divergence(d, None, interval)
    rungs = p.tail_distances(end)
    assert rungs[0] == p.tail_distance(end)
    assert len(set(rungs)) == len(rungs) and all(x % BS == 0 and 0 <= x < max(end, BS) for x in rungs)
    assert capacity > 0 or len(rungs) == 1


def test_a_rung_counts_from_the_hit_and_is_no_base_for_later_positions() -> None:
    pool = StatePool(8, BS, bytes_per_slot=1, flops_per_token=1.0)
    sm = StateManager(pool, BS, enable_caching=True)
    hashes = list(range(100, 110))
    sm.admit("a", PAD_SLOT_ID)
    sm.plan("a", hashes, [Position(8, False, False, Source.TAIL)])  # a's own checkpoint after 8 tokens
    r = Request("a", list(range(40)), 1)
    r.block_hashes = hashes
    sm.commit(r, [p.write for p in sm.pending["a"]])
    sm.free("a")
    sm.admit("b", pool.lookup(hashes[1]))  # b hits it: the base is 8
    sites = [(12, Source.LADDER), (20, Source.TAIL), (28, Source.LADDER), (36, Source.PROMPT_END)]
    sm.plan("b", hashes, [Position(p, False, False, src) for p, src in sites])
    values = [plan.value_tokens for plan in sm.pending["b"]]
    # rungs 12 and 28 count from the hit (4, 20); the tail from the hit too (12), the prompt end from the tail
    assert values == [4, 12, 20, 16]
    assert sm._base["b"] == 36


def test_rungs_go_straight_to_the_tier_and_a_sharer_hits_one_from_there() -> None:
    sched = make_scheduler("hybrid", "recap", BS, 200, 8, max_num_seqs=2, max_num_batched_tokens=64,
                           cache_disk_bytes=1000, kv_bytes_per_token=1, state_bytes_per_slot=10)  # fmt: skip
    h = Harness(sched)
    assert sched.cache.policy.tier_capacity == 100
    doc = list(range(100, 140))
    h.run_one(req("a", doc + list(range(500, 510)), max_tokens=1))  # prompt end 48
    for i, n in enumerate((36, 28, 20)):  # sharers leave a's chain 12, 20 and 28 tokens before its end
        h.run_one(req(f"s{i}", doc[:n] + list(range(600 + 20 * i, 610 + 20 * i)), max_tokens=1))
    # distances 12, 20, 28: d (prompt end 56) has its tail at 56 - 28 (3 x 28 beats 2 x 36, 1 x 44), rungs 36, 44
    d = h.run_one(req("d", list(range(1000, 1058)), max_tokens=1))
    pool, tiers = sched.cache.state.pool, sched.tiers  # type: ignore[union-attr]
    assert tiers is not None and sched.cache.state.num_written_through == 2  # type: ignore[union-attr]
    h.step()  # registered after d's last step: the saves go out with the next one
    h.step()  # and are reported one step after their order
    disk = tiers.tier("disk")
    mine = set(d.block_hashes)
    on_disk = {k.position for k in disk.iter_keys() if k.kind == EntryKind.CHECKPOINT and k.block_hash in mine}
    held = {pool.slot_position[s] for s in map(pool.lookup, d.block_hashes) if s is not None}
    assert on_disk == {36, 44} and all(disk.is_ready(k) for k in disk.iter_keys())  # the rungs: written through
    assert 28 in held  # the tail stays in the read pool
    e = h.run_one(req("e", d.prompt_token_ids[:40] + list(range(2000, 2012)), max_tokens=2))
    assert e.num_cached_tokens == 36  # the rung, promoted from the disk tier (the executor checks its state)
