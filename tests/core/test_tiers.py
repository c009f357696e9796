"""The disk tier in the core: demotion order, promotion (a deeper hit from the tier), faults falling back to
the deepest consistent point, and a random blast with a tier and the integrity check around every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.request import RequestStatus
from recap.core.tier_index import EntryKind, TierKey
from tests.core.helpers import Harness, make_scheduler, req
from tests.core.test_blast import VOCAB, make_request

BS = 4
KV_BYTES = BS * 1  # kv_bytes_per_token=1
STATE_BYTES = 10
FAILED_SAVE = 0.03  # blasts: the chance per step that the next save fails (a full disk)


def tiered(num_kv_blocks: int = 6, num_state_slots: int = 3, disk: int = 1000, kind: str = "hybrid",
           policy: str = "all") -> Harness:  # fmt: skip
    sched = make_scheduler(kind, policy, BS, num_kv_blocks, num_state_slots, max_num_seqs=2,
                           max_num_batched_tokens=64, cache_disk_bytes=disk, kv_bytes_per_token=1,
                           state_bytes_per_slot=STATE_BYTES)  # fmt: skip
    return Harness(sched)


def prompt(seed: int, n: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_evicted_blocks_and_checkpoints_are_saved_then_promoted() -> None:
    h = tiered()
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))  # 5 usable blocks: b evicts a's cached blocks
    h.step()  # saves are reported one step after their order
    tiers = h.sched.tiers
    assert tiers is not None
    index = tiers.tier("disk")
    saved = {k for k in index.iter_keys() if index.is_ready(k)}
    assert {TierKey(EntryKind.KV, x) for x in a.block_hashes[1:4]} <= saved  # tail first; block 0 stays
    assert h.executor.tier.num_saves == index.counters.demotions
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    assert h.executor.tier.num_loads == 1
    # 3 slots: a ran with 2 checkpoints (4, 8), both evicted to the tier by b; block 0 stayed in the pool.
    assert c.num_cached_tokens == 8  # block 1 and the checkpoint at 8 from the tier (the executor checks both)
    assert index.counters.promotions == 2 and index.counters.hits == 2
    assert h.finished["c"].finished == RequestStatus.FINISHED_LENGTH


def test_entries_still_being_written_are_read_in_order() -> None:
    """A store far behind on its writes (no save reported): a load ordered after the saves still reads them, so
    the hit does not depend on how fast the disk is; the reports arriving later only mark the entries written."""
    h = tiered()
    h.executor.tier.hold_reports = True
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))
    index = h.sched.tiers.tier("disk")  # type: ignore[union-attr]
    assert index.num_entries > 0 and index.num_ready == 0
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    assert c.num_cached_tokens == 8 and index.counters.promotions == 2  # the executor checked the loaded data
    h.executor.tier.hold_reports = False
    h.step()
    assert index.num_ready == index.num_entries
    index.check()


def test_a_save_that_fails_under_a_load_fails_the_load_only() -> None:
    """The save of a pending entry a load reads fails (disk full): the load falls back to what the pools hold,
    the output is still right, and the entry is forgotten once the load ends."""
    h = tiered()
    tier = h.executor.tier
    tier.hold_reports = True
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    tier.fail_saves = 1000  # every save b's eviction orders fails
    h.run_one(req("b", prompt(2), max_tokens=1))
    tier.fail_saves = 0
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    assert h.finished["c"].finished == RequestStatus.FINISHED_LENGTH and c.num_cached_tokens < 8
    tier.hold_reports = False
    h.step()
    index = h.sched.tiers.tier("disk")  # type: ignore[union-attr]
    assert index.counters.saves_failed > 0 and index.counters.promotions_failed > 0
    assert all(index.is_ready(k) for k in index.iter_keys())
    index.check()


def test_lru_budget_drops_oldest_entries() -> None:
    h = tiered(disk=3 * KV_BYTES, kind="attention")
    for i in range(4):
        h.run_one(req(f"r{i}", prompt(10 + i), max_tokens=1))
    index = h.sched.tiers.tier("disk")  # type: ignore[union-attr]
    assert index.num_bytes <= 3 * KV_BYTES and index.num_entries == 3
    assert index.counters.evictions == index.counters.demotions - 3
    last = h.requests["r2"].block_hashes  # r3 evicted r2's blocks last: they are the ones kept
    kept = {k.block_hash for k in index.iter_keys()}
    assert kept <= set(last) | set(h.requests["r1"].block_hashes)


def test_corrupt_entry_falls_back_to_the_deepest_consistent_point() -> None:
    h = tiered()
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))
    h.step()
    h.executor.tier.corrupt.add(TierKey(EntryKind.KV, a.block_hashes[1]))  # block 1's file is bad
    c = h.run_one(req("c", a.all_token_ids + [5], max_tokens=2))
    index = h.sched.tiers.tier("disk")  # type: ignore[union-attr]
    assert index.counters.promotions_failed >= 1
    assert not index.has_kv(a.block_hashes[1])
    assert c.num_cached_tokens < 8 and h.finished["c"].finished == RequestStatus.FINISHED_LENGTH


def test_store_turned_off_forgets_the_tier() -> None:
    h = tiered()
    h.run_one(req("a", prompt(1), max_tokens=1))
    h.executor.tier.disable_next = 0
    h.run_one(req("b", prompt(2), max_tokens=1))
    tiers = h.sched.tiers
    assert tiers is not None and not tiers.enabled and tiers.tier("disk").num_entries == 0
    h.run_one(req("c", prompt(3), max_tokens=1))
    assert tiers.tier("disk").num_entries == 0


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(("hybrid", "attention", "ssm")),
    policy=st.sampled_from(("align", "all", "recap")),
    block_size=st.sampled_from([1, 2, 4]),
    num_kv_blocks=st.integers(2, 24),
    num_state_slots=st.integers(1, 8),
    disk_entries=st.integers(0, 30),
    seed=st.integers(0, 2**31),
)
def test_blast_with_tier(kind: str, policy: str, block_size: int, num_kv_blocks: int, num_state_slots: int,
                         disk_entries: int, seed: int) -> None:  # fmt: skip
    sched = make_scheduler(kind, policy, block_size, num_kv_blocks, num_state_slots, 4, 24, 64,
                           cache_disk_bytes=disk_entries * 3, kv_bytes_per_token=1, state_bytes_per_slot=3)  # fmt: skip
    rng = random.Random(seed)
    h = Harness(sched, seed=seed)
    h.executor.vocab_size = VOCAB
    tier = h.executor.tier
    bases = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    added, done = [], []
    for step in range(200):
        if step < 140 and rng.random() < 0.4:
            r = make_request(rng, f"r{len(added)}", bases, done, 64)
            added.append(h.add(r))
        live = [r for r in added if sched.get_request(r.request_id) is not None]
        if live and rng.random() < 0.04:
            sched.abort_requests([rng.choice(live).request_id])
        if tier.store and rng.random() < 0.1:
            tier.corrupt.add(rng.choice(sorted(tier.store))[1])
        if rng.random() < FAILED_SAVE:
            tier.fail_saves += 1
        if rng.random() < 0.01:
            assert sched.reset_prefix_cache()
        out = sched.schedule()
        sched.check_integrity()
        result = h.executor.execute(out)
        if out.scheduled and rng.random() < 0.04:
            sched.abort_requests([rng.choice(out.scheduled).request_id])
        sched.update_from_output(out, result)
        sched.check_integrity()
        done = [r for r in added if r.is_finished and r.output_token_ids]
    h.run(max_steps=5000)
    assert all(r.is_finished for r in added)
    assert sched.tiers is None or not sched.tiers.promoting
    if sched.cache.kv:
        assert sched.cache.kv.pool.num_in_use == 0
    if sched.cache.state:
        assert sched.cache.state.pool.num_in_use == 0
