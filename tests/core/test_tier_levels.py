"""Host memory then disk under the read pools (core/tiers.py with two TierIndexes): exact placement and
demotion order with tiny tiers, a promotion reading KV and state from different tiers, and a random blast with
both tiers and the integrity check around every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.config import CacheConfig
from recap.core.output import TierDrop, TierSave, TierSaved
from recap.core.request import RequestStatus
from recap.core.scheduler import Scheduler
from recap.core.tier_index import EntryKind, TierKey
from recap.core.tiers import TierManager
from tests.core.helpers import Harness, make_scheduler, req
from tests.core.test_blast import VOCAB, make_request
from tests.core.test_tiers import BS, FAILED_SAVE, KV_BYTES, STATE_BYTES, prompt

HOST, DISK = 0, 1
CORRUPT = 0.05


def kv(h: int) -> TierKey:
    return TierKey(EntryKind.KV, h)


def manager(host_entries: int, disk_entries: int) -> TierManager:
    sched = make_scheduler("attention", "all", BS, 6, 3, cache_host_bytes=host_entries * KV_BYTES,
                           cache_disk_bytes=disk_entries * KV_BYTES, kv_bytes_per_token=1)  # fmt: skip
    assert sched.tiers is not None and [t.name for t in sched.tiers.indexes] == ["host", "disk"]
    return sched.tiers


def demote(tiers: TierManager, h: int, written: bool = True) -> tuple[list[TierSave], list[TierDrop]]:
    """Demote KV block hash `h` from the pool; report its saves written (unless not `written`)."""
    tiers.demote_kv(100 + h, h)
    saves, drops = tiers.take_orders()
    if written:
        tiers.saved([TierSaved(s.key, True, s.level) for s in saves])
    return saves, drops


def held(tiers: TierManager, level: int) -> list[int]:
    return [k.block_hash for k in tiers.indexes[level].iter_keys()]  # LRU first


def test_host_first_then_lru_moves_down_then_out() -> None:
    tiers = manager(2, 3)
    assert demote(tiers, 1) == ([TierSave(kv(1), 101, HOST)], [])
    demote(tiers, 2)
    # host full: its LRU entry moves to disk (a save from the host copy, then the host copy's drop)
    assert demote(tiers, 3) == ([TierSave(kv(3), 103, HOST), TierSave(kv(1), 0, DISK, HOST)], [TierDrop(kv(1), HOST)])
    assert (held(tiers, HOST), held(tiers, DISK)) == ([2, 3], [1])
    demote(tiers, 4)
    demote(tiers, 5)
    assert (held(tiers, HOST), held(tiers, DISK)) == ([4, 5], [1, 2, 3])
    # disk full too: the disk's LRU entry is gone
    saves, drops = demote(tiers, 6)
    assert saves == [TierSave(kv(6), 106, HOST), TierSave(kv(4), 0, DISK, HOST)]
    assert drops == [TierDrop(kv(4), HOST), TierDrop(kv(1), DISK)]
    assert (held(tiers, HOST), held(tiers, DISK)) == ([5, 6], [2, 3, 4])
    # a demotion of an entry a tier holds only refreshes it there: no write, no move
    assert demote(tiers, 2) == ([], [])
    assert held(tiers, DISK) == [3, 4, 2]
    demote(tiers, 7)  # 5 moves down, evicting 3 (2 was refreshed)
    assert (held(tiers, HOST), held(tiers, DISK)) == ([6, 7], [4, 2, 5])
    host, disk = tiers.indexes
    assert host.counters.demotions == 7 and host.counters.evictions == 5
    assert disk.counters.demotions == 5 and disk.counters.evictions == 2
    for t in tiers.indexes:
        t.check()
    assert host.num_bytes == 2 * KV_BYTES and disk.num_bytes == 3 * KV_BYTES


def test_budgets_are_checked_and_name_the_tiers_in_order() -> None:
    with pytest.raises(ValueError, match="cache_host_bytes"):
        CacheConfig(cache_host_bytes=-1)
    assert CacheConfig(cache_host_bytes=8).tier_names == ("host",)
    assert CacheConfig(cache_host_bytes=8, cache_dir="/x").tier_names == ("host", "disk")
    assert CacheConfig(cache_host_bytes=0, cache_dir="/x", cache_disk_bytes=0).tier_names == ()


def test_host_full_of_pending_entries_passes_to_disk() -> None:
    tiers = manager(2, 3)
    demote(tiers, 1, written=False)
    demote(tiers, 2, written=False)
    saves, drops = demote(tiers, 3, written=False)  # nothing in the host can leave: the entry goes straight to disk
    assert saves == [TierSave(kv(3), 103, DISK)] and drops == []
    assert tiers.indexes[HOST].counters.demotions_declined == 1
    tiers.saved([TierSaved(kv(1), False, HOST)])  # a failed save frees its bytes
    assert held(tiers, HOST) == [2] and tiers.indexes[HOST].counters.saves_failed == 1


def test_flush_copies_host_and_pools_into_disk() -> None:
    tiers = manager(2, 8)
    for h in (1, 2, 3):
        demote(tiers, h)
    saves, drops = tiers.flush()
    assert drops == [] and [(s.key, s.level, s.from_level) for s in saves] == [(kv(2), DISK, HOST), (kv(3), DISK, HOST)]
    assert held(tiers, HOST) == [2, 3] and held(tiers, DISK) == [1, 2, 3]  # deliberately duplicated at shutdown


def tiered(host: int, disk: int) -> Harness:
    sched = make_scheduler("hybrid", "all", BS, 6, 3, max_num_seqs=2, max_num_batched_tokens=64,
                           cache_host_bytes=host, cache_disk_bytes=disk, kv_bytes_per_token=1,
                           state_bytes_per_slot=STATE_BYTES)  # fmt: skip
    return Harness(sched)


def test_promotion_reads_kv_and_state_from_different_tiers() -> None:
    """A host tier of three KV blocks: b's run pushes a's checkpoints (demoted first) on to disk while a's KV
    blocks 1-3 stay in the host; a's next turn reads block 1 from the host and the checkpoint at 8 from disk."""
    h = tiered(host=3 * KV_BYTES + 2, disk=1000)
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))
    h.step()
    tiers = h.sched.tiers
    assert tiers is not None
    loads = []
    real_plan = tiers.plan
    tiers.plan = lambda r, hit: loads.append(real_plan(r, hit)) or loads[-1]  # type: ignore[method-assign]
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    load = next(ld for ld in loads if ld is not None)
    assert [(key.kind, level) for key, _, level in load.entries()] == [(EntryKind.KV, HOST),
                                                                       (EntryKind.CHECKPOINT, DISK)]
    assert c.num_cached_tokens == 8  # the validating executor checked every loaded block and slot
    assert h.finished["c"].finished == RequestStatus.FINISHED_LENGTH
    assert sum(t.counters.promotions for t in tiers.indexes) == 2


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(("hybrid", "attention", "ssm")),
    policy=st.sampled_from(("align", "all", "recap")),
    block_size=st.sampled_from([1, 2, 4]),
    num_kv_blocks=st.integers(2, 24),
    num_state_slots=st.integers(1, 8),
    host_entries=st.integers(0, 12),
    disk_entries=st.integers(0, 30),
    seed=st.integers(0, 2**31),
)
def test_blast_with_host_and_disk(kind: str, policy: str, block_size: int, num_kv_blocks: int, num_state_slots: int,
                                  host_entries: int, disk_entries: int, seed: int) -> None:  # fmt: skip
    sched = make_scheduler(kind, policy, block_size, num_kv_blocks, num_state_slots, 4, 24, 64,
                           cache_host_bytes=host_entries * 3, cache_disk_bytes=disk_entries * 3, kv_bytes_per_token=1,
                           state_bytes_per_slot=3)  # fmt: skip
    run_tier_blast(sched, seed)


def run_tier_blast(sched: Scheduler, seed: int) -> None:
    """Random requests over 200 steps with corrupt entries, failed saves, a tier turned off and aborts, integrity
    checked every step and every store against its index; then every request finishes, nothing is held or
    being loaded, every pool is idle and every tier entry is written."""
    rng = random.Random(seed)
    h = Harness(sched, seed=seed)
    h.executor.vocab_size = VOCAB
    tier = h.executor.tier
    bases = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    added, done = [], []
    for step in range(200):
        if step < 140 and rng.random() < 0.4:
            added.append(h.add(make_request(rng, f"r{len(added)}", bases, done, 64)))
        if tier.store and rng.random() < CORRUPT:
            tier.corrupt.add(rng.choice(sorted(tier.store))[1])
        if rng.random() < FAILED_SAVE:
            tier.fail_saves += 1
        if sched.tiers is not None and rng.random() < 0.005:
            tier.disable_next = rng.randrange(len(sched.tiers.indexes))
        out = sched.schedule()
        sched.check_integrity()  # accounting per tier, an entry in one tier at most, pins = loads
        result = h.executor.execute(out)
        if out.scheduled and rng.random() < 0.04:
            sched.abort_requests([rng.choice(out.scheduled).request_id])
        sched.update_from_output(out, result)
        sched.check_integrity()
        _check_store_matches(sched.tiers, tier.store)
        done = [r for r in added if r.is_finished and r.output_token_ids]
    h.run(max_steps=5000)
    h.step()  # the last saves' reports
    assert all(r.is_finished for r in added)
    tiers = sched.tiers
    assert tiers is None or not tiers.promoting
    for group in (sched.cache.kv, sched.cache.window, sched.cache.state):
        assert group is None or group.pool.num_in_use == 0
    if tiers is not None:
        assert not tiers.saves and all(t.is_ready(k) for t in tiers.indexes for k in t.iter_keys()), "pending entry"


def _check_store_matches(tiers: TierManager | None, store: dict[tuple[int, TierKey], object]) -> None:
    """Every READY entry of a tier is in that tier's store (the bytes a load would read are there); a pinned one may
    have failed another load already (it is forgotten when its own load fails too)."""
    if tiers is None:
        return
    for level, index in enumerate(tiers.indexes):
        if level in tiers.disabled:
            continue
        for key in index.iter_keys():
            ok = not index.is_ready(key) or index.is_pinned(key) or (level, key) in store
            assert ok, f"tier {level} holds {key} but its store does not"
