"""State pool: slot roles, segmented eviction (probation LRU, protected by utility), pinning, provenance."""

from __future__ import annotations

import pytest

from recap.core.output import CheckpointWrite
from recap.core.state_pool import SlotKind, StatePool

BS = 4


def chain(position: int, h: int) -> list[int]:
    """A request's block hashes whose hash after `position` tokens is h."""
    k = position // BS
    return [1000 + i for i in range(k - 1)] + [h]


def put(pool: StatePool, position: int, h: int, proven: bool = False) -> int:
    slot = pool.allocate_checkpoint(position, proven)
    assert slot is not None
    w = CheckpointWrite(position, slot)
    assert pool.register(w, w, h, chain(position, h), proven)
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


def test_probation_goes_first_oldest_first_whatever_its_depth() -> None:
    pool = make()
    a, b, c, d = put(pool, 4, 1), put(pool, 8, 2), put(pool, 4, 3), put(pool, 16, 4)
    assert (a, b, c, d) == (0, 1, 2, 3)
    pool.touch(c)  # a hit: c moves to the protected segment
    assert list(pool.probation) == [a, b, d] and pool.protected == {c}
    assert pool.allocate_running() == a
    assert pool.allocate_running() == b
    assert pool.allocate_running() == d  # deepest, but never shared
    assert pool.allocate_running() == c
    assert pool.allocate_running() is None
    assert pool.num_evicted == 4
    pool.check()


def test_protected_by_utility_then_recency_when_over_its_share() -> None:
    pool = make()  # 4 slots: protected may hold 3
    a, b, c, d = put(pool, 4, 1), put(pool, 8, 2), put(pool, 12, 3), put(pool, 16, 4, proven=True)
    for slot in (a, b, c):
        pool.touch(slot)
    assert pool.protected == {a, b, c, d} and not pool.probation
    # Priorities L + value: a=4, b=8, c=12, d=16; four protected exceed the share of three.
    assert pool.allocate_running() == a
    pool.check()


def test_deep_checkpoint_outlives_shallow_recent_ones_until_inflation_catches_up() -> None:
    pool = make(2)  # protected share: one slot
    deep = put(pool, 40, 1, proven=True)
    shallow = put(pool, 4, 2, proven=True)
    assert pool.allocate_running() == shallow  # L = 4
    pool.free(shallow)
    # Write k (k >= 2) evicts write k-1 (priority 4k) and raises L to 4k; the deep checkpoint
    # (priority 40) goes at write 10, where it ties with write 9 and is the older.
    evicted_at = None
    for k in range(1, 13):
        slot = pool.allocate_checkpoint(4, proven=True)
        assert slot is not None
        w = CheckpointWrite(4, slot)
        assert pool.register(w, w, 100 + k, chain(4, 100 + k), proven=True)
        if evicted_at is None and pool.lookup(1) is None:
            evicted_at = k
    assert deep in (0, 1) and evicted_at == 10
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


def test_speculative_checkpoint_never_displaces_a_protected_one() -> None:
    pool = make(2)
    run = pool.allocate_running()
    deep = put(pool, 64, 1, proven=True)
    assert pool.allocate_checkpoint(4) is None  # unproven: only probation may make room
    assert pool.lookup(1) == deep
    assert pool.allocate_checkpoint(4, proven=True) == deep  # proven: the lowest protected goes
    pool.free(deep)
    pool.free(run)
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
    assert not pool.register(written, planned, h, hashes), why
    assert pool.num_refused == 1 and pool.num_checkpoints == 0 and pool.lookup(h) is None
    assert pool.kind[slot] == SlotKind.FREE or written.slot != slot


def test_registration_refuses_unaligned_position() -> None:
    pool = make()
    slot = pool.allocate_checkpoint(6)
    assert slot is not None
    w = CheckpointWrite(6, slot)
    assert not pool.register(w, w, 5, [5, 5])
    assert pool.num_refused == 1 and pool.kind[slot] == SlotKind.FREE


def test_duplicate_registration_keeps_the_first() -> None:
    pool = make()
    first = put(pool, 8, 5)
    slot = pool.allocate_checkpoint(8)
    assert slot is not None
    w = CheckpointWrite(8, slot)
    assert not pool.register(w, w, 5, chain(8, 5))
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
