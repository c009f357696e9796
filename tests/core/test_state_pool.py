"""State pool: slot roles, GreedyDual-Size-Frequency eviction on marginal value, pinning, provenance."""

from __future__ import annotations

from typing import Any

import pytest

from recap.bench.replay_pool import ReplayStatePool
from recap.core.output import CheckpointWrite
from recap.core.state_pool import PlannedWrite, SlotKind, StatePool

BS = 4


def chain(position: int, h: int) -> list[int]:
    """A request's block hashes whose hash after `position` tokens is h."""
    k = position // BS
    return [1000 + i for i in range(k - 1)] + [h]


def register(
    pool: StatePool, written: CheckpointWrite, planned: CheckpointWrite, h: int, hashes: list[int], **plan: Any
) -> bool:
    """Register one planned write given the kernels' report `written`."""
    return pool.register([PlannedWrite(planned, h, **plan)], [written], hashes) == [True]


def put(pool: StatePool, position: int, h: int, proven: bool = False, value: int | None = None) -> int:
    slot = pool.allocate_checkpoint(position, proven, value)
    assert slot is not None
    w = CheckpointWrite(position, slot)
    assert register(pool, w, w, h, chain(position, h), proven=proven, value_tokens=value or 0)
    return slot


def make(num_slots: int = 4) -> StatePool:
    return StatePool(num_slots, BS, bytes_per_slot=1, flops_per_token=1.0)


def test_roles_and_counts() -> None:
    pool = make()
    run = pool.allocate_running()
    assert run == 0 and pool.kind[0] == SlotKind.RUNNING
    s = put(pool, 8, 7)
    assert s == 1 and pool.lookup(7) == 1 and pool.num_checkpoints == 1
    assert pool.num_free == 2 and pool.num_in_use == 1 and pool.num_available == 3
    pool.free(run)
    pool.check()


def test_lowest_value_goes_first_and_a_hit_doubles_a_checkpoints_weight() -> None:
    pool = make()
    a, b, c, d = put(pool, 4, 1), put(pool, 8, 2), put(pool, 4, 3), put(pool, 16, 4)
    assert (a, b, c, d) == (0, 1, 2, 3)
    assert [pool.priority(s) for s in (a, b, c, d)] == [4, 8, 4, 16]
    pool.touch(c)  # a hit: value 4 x (1 + 1)
    assert pool.priority(c) == 8
    assert pool.allocate_running() == a  # L = 4
    assert pool.allocate_running() == b  # 8 ties with c's 8: the older entry goes; L = 8
    assert pool.allocate_running() == c
    assert pool.allocate_running() == d
    assert pool.allocate_running() is None
    assert pool.num_evicted == 4
    pool.check()


def test_value_is_measured_from_the_writers_shallower_checkpoint_not_from_zero() -> None:
    pool = make()
    doc = put(pool, 64, 1)  # a fresh document's tail: worth all 64 tokens
    sibling = put(pool, 68, 2, value=4)  # one block past the hit at 64: worth 4
    branch = put(pool, 72, 3, proven=True, value=8)  # sharing observed: 8 x 2
    assert [pool.priority(s) for s in (doc, sibling, branch)] == [64, 4, 16]
    assert pool.allocate_running() == 3  # the free slot goes before any eviction
    assert pool.allocate_running() == sibling
    assert pool.allocate_running() == branch
    assert pool.lookup(1) == doc
    pool.check()


def test_deep_checkpoint_outlives_shallow_recent_ones_until_inflation_catches_up() -> None:
    pool = make(2)
    deep = put(pool, 40, 1)
    shallow = put(pool, 4, 2)
    assert pool.allocate_running() == shallow  # L = 4
    pool.free(shallow)
    # Write k (k >= 2) evicts write k-1 (priority 4k) and raises L to 4k; the deep checkpoint
    # (priority 40) goes at write 10, where it ties with write 9 and is the older.
    evicted_at = None
    for k in range(1, 13):
        slot = pool.allocate_checkpoint(4)
        assert slot is not None
        w = CheckpointWrite(4, slot)
        assert register(pool, w, w, 100 + k, chain(4, 100 + k))
        if evicted_at is None and pool.lookup(1) is None:
            evicted_at = k
    assert deep in (0, 1) and evicted_at == 10
    pool.check()


def test_a_checkpoint_worth_less_than_every_evictable_one_is_declined() -> None:
    pool = make(2)
    run = pool.allocate_running()
    deep = put(pool, 64, 1, proven=True)  # priority 128
    assert pool.allocate_checkpoint(4, value_tokens=4) is None  # 4 < 128: declined, L rises to 4
    assert pool.num_declined == 1 and pool.lookup(1) == deep
    assert pool.allocate_checkpoint(128, proven=True) == deep  # 4 + 256 > 128: displaces it
    assert pool.num_evicted == 1
    pool.free(deep)
    pool.free(run)
    pool.check()


def test_pinned_checkpoint_is_never_evicted() -> None:
    pool = make(2)
    a, b = put(pool, 4, 1), put(pool, 8, 2)
    pool.pin(a)
    assert pool.num_available == 1
    assert pool.allocate_running() == b
    assert pool.allocate_running() is None  # only the pinned one is left
    pool.unpin(a)
    assert pool.allocate_running() == a
    pool.check()


def test_an_eviction_past_a_pinned_checkpoint_keeps_the_order() -> None:
    pool = make(3)
    a, b, c = put(pool, 4, 1), put(pool, 4, 2), put(pool, 4, 3)  # equal priorities: the oldest goes first
    pool.pin(a)
    assert pool.allocate_running() == b  # found past the pinned one
    pool.check()
    pool.unpin(a)
    assert pool.allocate_running() == a
    assert pool.allocate_running() == c
    assert pool.allocate_running() is None
    pool.check()


@pytest.mark.parametrize(
    ("written", "h", "why"),
    [
        (CheckpointWrite(12, 0), 5, "position differs from the plan"),
        (CheckpointWrite(8, 1), 5, "slot differs from the plan"),
        (CheckpointWrite(8, 0), 6, "hash is not the request's at that position"),
    ],
)
def test_registration_refuses_provenance_mismatch(written: CheckpointWrite, h: int, why: str) -> None:
    pool = make()
    slot = pool.allocate_checkpoint(8)
    assert slot == 0
    planned = CheckpointWrite(8, slot)
    hashes = chain(8, 5) + [9, 9]
    if written.slot != slot:
        other = pool.allocate_checkpoint(8)
        assert other == written.slot
    assert not register(pool, written, planned, h, hashes), why
    assert pool.num_refused == 1 and pool.num_checkpoints == 0 and pool.lookup(h) is None
    assert pool.kind[slot] == SlotKind.FREE or written.slot != slot


def test_registration_refuses_unaligned_position() -> None:
    pool = make()
    slot = pool.allocate_checkpoint(6)
    assert slot is not None
    w = CheckpointWrite(6, slot)
    assert not register(pool, w, w, 5, [5, 5])
    assert pool.num_refused == 1 and pool.kind[slot] == SlotKind.FREE


def test_duplicate_registration_keeps_the_first() -> None:
    pool = make()
    first = put(pool, 8, 5)
    slot = pool.allocate_checkpoint(8)
    assert slot is not None
    w = CheckpointWrite(8, slot)
    assert not register(pool, w, w, 5, chain(8, 5))
    assert pool.lookup(5) == first and pool.num_duplicates == 1 and pool.kind[slot] == SlotKind.FREE
    pool.check()


def test_drop_spares_used_and_pinned_checkpoints() -> None:
    pool = make()
    a, b, c = put(pool, 4, 1), put(pool, 8, 2), put(pool, 12, 3)
    pool.touch(b)
    pool.pin(c)
    assert pool.drop(a, 1) and pool.lookup(1) is None
    assert not pool.drop(b, 2)  # hit since registration: someone wants it
    assert not pool.drop(c, 3)  # pinned
    assert not pool.drop(b, 99)  # the slot holds another key
    pool.unpin(c)
    pool.check()


def test_reset_drops_unpinned_checkpoints() -> None:
    pool = make()
    a = put(pool, 4, 1)
    put(pool, 8, 2)
    pool.pin(a)
    assert pool.reset() == 1
    assert pool.lookup(1) == a and pool.lookup(2) is None
    pool.unpin(a)
    pool.check()


def test_a_checkpoint_whose_kv_block_was_evicted_is_dropped() -> None:
    pool = make(3)
    a, b = put(pool, 8, 1), put(pool, 8, 2)
    pool.pin(b)
    pool.strand(1)
    pool.strand(2)  # pinned: a copy from it is in flight, and its KV blocks are held by that request
    pool.strand(99)  # no checkpoint there
    assert pool.lookup(1) is None and pool.kind[a] == SlotKind.FREE and pool.num_stranded == 1
    assert pool.lookup(2) == b
    assert pool.allocate_running() == a  # the freed slot, nothing evicted
    assert pool.num_evicted == 0
    pool.unpin(b)
    pool.check()


def test_a_stranded_checkpoint_is_no_verdict_on_its_source() -> None:
    # Its KV left, which says nothing about where it sat. Reported as a miss, it would make the policy
    # stop writing that source whenever KV is the tight budget (docs/replay.md, equal bytes).
    pool = make(2)
    outcomes: list[tuple[int, bool]] = []
    pool.on_outcome = lambda source, hit: outcomes.append((source, hit))
    put(pool, 8, 1)
    put(pool, 8, 2)
    pool.strand(1)
    assert outcomes == [] and pool.num_stranded == 1
    put(pool, 12, 3)  # the freed slot
    put(pool, 16, 4)  # evicts checkpoint 2, never hit: that one is a miss of its source
    assert pool.lookup(2) is None and outcomes == [(0, False)]
    pool.check()


@pytest.mark.parametrize("replay", [False, True])
def test_a_checkpoint_demoted_to_a_lower_tier_is_no_miss(replay: bool) -> None:
    # It may still hit from the tier: the policy's tiers rationed speculative sources (its tail ladder);
    # reported as misses, a ladder's rungs shut the single tail off (docs/replay.md, lower tiers).
    pool = ReplayStatePool.adopt(make(1)) if replay else make(1)
    outcomes: list[tuple[int, bool]] = []
    spilled: list[int] = []
    pool.on_outcome = lambda source, hit: outcomes.append((source, hit))
    pool.on_spill = lambda slot, h, position, stranded: spilled.append(h)
    put(pool, 8, 1)
    put(pool, 16, 2)  # evicts checkpoint 1 into the tier
    assert spilled == [1] and outcomes == [] and pool.num_evicted == 1
    pool.check()


def test_register_a_chunk_of_plans_sorts_each_outcome() -> None:
    pool = make(6)
    first = put(pool, 4, 1)
    hashes = [1, 2, 3, 4]
    a, b, c, d = (pool.allocate_checkpoint(4 * (i + 1)) for i in range(4))
    assert None not in (a, b, c, d)
    plans = [
        PlannedWrite(CheckpointWrite(4, a), 1),  # duplicate: key 1 is registered already
        PlannedWrite(CheckpointWrite(8, b), 2),  # registered
        PlannedWrite(CheckpointWrite(12, c), 3),  # planned but not written
        PlannedWrite(CheckpointWrite(16, d), 4),  # written at another position: refused
    ]
    unplanned = pool.allocate_running()
    written = [CheckpointWrite(4, a), CheckpointWrite(8, b), CheckpointWrite(12, d), CheckpointWrite(16, unplanned)]
    assert pool.register(plans, written, hashes) == [False, True, False, False]
    assert pool.num_duplicates == 1 and pool.num_refused == 2  # d's report, and the report nobody planned
    assert pool.lookup(1) == first and pool.lookup(2) == b and pool.lookup(3) is None and pool.lookup(4) is None
    assert all(pool.kind[s] == SlotKind.FREE for s in (a, c, d)) and pool.kind[unplanned] == SlotKind.RUNNING
    pool.free(unplanned)
    pool.check()


def test_a_chunk_of_asks_is_served_in_order() -> None:
    """One call behaves as the asks one by one: an eviction by an earlier ask frees a later ask's key."""
    pool = make(2)
    put(pool, 4, 10)
    put(pool, 8, 20)  # priority 8 > 4: the key-10 checkpoint is the lowest
    slots = pool.allocate_checkpoints([(20, 4, False), (99, 64, False), (10, 64, False), (98, 64, False)])
    # key 20 is registered: skipped; 99 evicts key 10, so key 10 is askable again and evicts key 20;
    # nothing is left to evict for 98.
    assert slots[0] is None and slots[1] is not None and slots[2] is not None and slots[3] is None
    assert pool.num_already_registered == 1 and pool.num_evicted == 2 and pool.num_declined == 1
    assert pool.lookup(10) is None and pool.lookup(20) is None
    pool.check()
