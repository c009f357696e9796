"""TierIndex: exact LRU eviction order, byte budget, pending entries readable but never evicted, pins, failed saves."""

from __future__ import annotations

import pytest

from recap.core.tier_index import EntryKind, TierIndex, TierKey


def kv(h: int) -> TierKey:
    return TierKey(EntryKind.KV, h)


def cp(h: int, position: int) -> TierKey:
    return TierKey(EntryKind.CHECKPOINT, h, position)


def test_lru_order_and_budget() -> None:
    tier = TierIndex("disk", 30)
    for h in (1, 2, 3):
        assert tier.reserve(kv(h), 10) == []
        tier.mark_ready(kv(h))
    tier.touch(kv(1))  # order now 2, 3, 1
    assert tier.reserve(cp(4, 8), 15) == [kv(2), kv(3)]
    assert not tier.has_kv(2) and tier.has_kv(1) and tier.num_bytes == 25
    assert tier.checkpoint_key(4) == cp(4, 8) and not tier.is_ready(cp(4, 8))  # pending: a later load reads it
    tier.mark_ready(cp(4, 8))
    assert tier.checkpoint_key(4) == cp(4, 8) and tier.checkpoint_key(5) is None
    assert tier.counters.evictions == 2 and tier.counters.demotions == 4
    tier.check()


def test_pending_and_pinned_are_not_evicted() -> None:
    tier = TierIndex("disk", 20)
    tier.reserve(kv(1), 10)  # pending
    tier.reserve(kv(2), 10)
    tier.mark_ready(kv(2))
    tier.pin(kv(2))
    assert tier.reserve(kv(3), 5) is None  # nothing evictable: declined, nothing changed
    assert tier.num_bytes == 20 and tier.counters.demotions_declined == 1
    tier.unpin(kv(2))
    assert tier.reserve(kv(3), 5) == [kv(2)]
    assert tier.reserve(kv(4), 25) is None  # larger than the budget
    tier.check()


def test_a_failed_save_is_forgotten_once_no_load_reads_it() -> None:
    tier = TierIndex("disk", 30)
    tier.reserve(kv(1), 10)
    tier.reserve(cp(2, 16), 10)
    tier.fail(kv(1))  # nothing reads it: gone at once
    assert not tier.has(kv(1)) and not tier.kv_readable(1) and tier.num_bytes == 10
    tier.pin(cp(2, 16))
    tier.pin(cp(2, 16))
    tier.fail(cp(2, 16))  # two loads read it: they fail; nothing new may read it
    assert tier.checkpoint_key(2) is None and tier.has(cp(2, 16)) and tier.counters.saves_failed == 2
    with pytest.raises(AssertionError):
        tier.pin(cp(2, 16))
    tier.check()
    tier.unpin(cp(2, 16))
    assert tier.has(cp(2, 16))
    tier.unpin(cp(2, 16))
    assert not tier.has(cp(2, 16)) and tier.num_bytes == 0
    tier.check()


def test_add_ready_and_clear() -> None:
    tier = TierIndex("disk", 100)
    assert tier.add_ready(cp(7, 16), 40) == []
    assert tier.is_ready(cp(7, 16)) and tier.counters.demotions == 0
    tier.reserve(kv(7), 10)
    with pytest.raises(AssertionError):
        tier.reserve(kv(7), 10)
    assert sorted(tier.clear()) == sorted([cp(7, 16), kv(7)])
    assert tier.num_bytes == 0 and tier.num_entries == 0
    tier.check()
    with pytest.raises(ValueError):
        TierIndex("disk", -1)
