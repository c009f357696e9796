"""Lower tiers for models with a sliding-window group: evicted window blocks are saved as their own entries,
a deeper hit loads the window blocks before it (besides KV and the checkpoint), a checkpoint stranded by its
window block's eviction follows it down, and a random blast over window layouts with host and disk tiers keeps
every invariant (the validating executor checks each loaded window block's content)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.output import TierLoad
from recap.core.request import RequestStatus
from recap.core.tier_index import EntryKind, TierKey
from tests.core.helpers import Harness, make_scheduler, record_loads, req
from tests.core.test_blast import WINDOW_KINDS
from tests.core.test_tier_levels import run_tier_blast
from tests.core.test_tiers import BS, STATE_BYTES, prompt


def tiered(kind: str, num_state_slots: int = 3, host: int | None = None, disk: int | None = 1000,
           **kw: object) -> Harness:  # fmt: skip
    """6 KV and window blocks (a window of 6 tokens: a hit needs the 2 blocks before it), 1 byte per token."""
    sched = make_scheduler(kind, "all", BS, 6, num_state_slots, max_num_seqs=2, max_num_batched_tokens=64,
                           cache_host_bytes=host, cache_disk_bytes=disk, kv_bytes_per_token=1,
                           state_bytes_per_slot=STATE_BYTES, window_bytes_per_token=1, **kw)  # fmt: skip
    return Harness(sched)


def kinds_of(load: TierLoad) -> list[EntryKind]:
    return [key.kind for key, _, _ in load.entries()]


# (kind, the returning turn's hit, the load's entries): 16 tokens of history; with a state group only the
# checkpoints at 4 and 8 fit 3 slots, so the hit is 8 and its window is blocks 0 and 1 (block 0 stayed cached).
CASES = [
    ("hybrid+window", 8, [EntryKind.KV, EntryKind.WINDOW, EntryKind.CHECKPOINT]),
    ("ssm+window", 8, [EntryKind.WINDOW, EntryKind.CHECKPOINT]),
    ("attention+window", 16, [EntryKind.KV] * 3 + [EntryKind.WINDOW] * 2),
    ("window", 16, [EntryKind.WINDOW] * 2),
]


@pytest.mark.parametrize(("kind", "hit", "entries"), CASES)
def test_window_blocks_are_saved_then_promoted(kind: str, hit: int, entries: list[EntryKind]) -> None:
    h = tiered(kind)
    tiers = h.sched.tiers
    assert tiers is not None and h.sched.cache.window is not None
    loads = record_loads(tiers)
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))  # 5 usable blocks per group: b evicts a's
    h.step()
    disk = tiers.tier("disk")
    window = {TierKey(EntryKind.WINDOW, x) for x in a.block_hashes[1:4]}
    assert window <= {k for k in disk.iter_keys() if disk.is_ready(k)}  # tail first; block 0 stays
    assert disk.num_bytes == sum(tiers.entry_bytes(k) for k in disk.iter_keys())
    assert tiers.entry_bytes(next(iter(window))) == BS  # the window rows of one block
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    assert c.num_cached_tokens == hit  # the executor checked every loaded block (window ones too) and slot
    assert len(loads) == 1 and kinds_of(loads[0]) == entries
    assert disk.counters.promotions == len(entries) and disk.counters.promotions_failed == 0
    assert h.finished["c"].finished == RequestStatus.FINISHED_LENGTH


def test_a_corrupt_window_entry_falls_back() -> None:
    """The window block just before the hit fails to load: no hit there (its window is incomplete); the output is
    still right and the entry is forgotten."""
    h = tiered("attention+window")
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))
    h.step()
    bad = TierKey(EntryKind.WINDOW, a.block_hashes[3])
    h.executor.tier.corrupt.add(bad)
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    disk = h.sched.tiers.tier("disk")  # type: ignore[union-attr]
    assert disk.counters.promotions_failed == 1 and not disk.has(bad)
    assert c.num_cached_tokens < 16 and h.finished["c"].finished == RequestStatus.FINISHED_LENGTH


def test_a_checkpoint_stranded_by_its_window_block_follows_it_down() -> None:
    """A state pool large enough to keep a's checkpoints: b evicts only a's window blocks, which strands the
    checkpoints ending on them; the window blocks went to the tier, so the checkpoints go too (a hit there needs
    both), and a's next turn hits its whole history from the tier."""
    h = tiered("ssm+window", num_state_slots=12)
    tiers = h.sched.tiers
    assert tiers is not None
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    h.run_one(req("b", prompt(2), max_tokens=1))
    disk = tiers.tier("disk")
    stranded = {k.position for k in disk.iter_keys() if k.kind == EntryKind.CHECKPOINT}
    assert {12, 16} <= stranded and h.sched.cache.state.pool.num_stranded >= 2  # type: ignore[union-attr]
    c = h.run_one(req("c", a.all_token_ids + [1, 2, 3], max_tokens=2))
    assert c.num_cached_tokens == 16


def test_flush_copies_window_blocks_into_the_last_tier() -> None:
    h = tiered("hybrid+window", host=10_000, disk=10_000)
    a = h.run_one(req("a", prompt(1), max_tokens=1))
    tiers = h.sched.tiers
    assert tiers is not None
    saves, _ = tiers.flush()
    flushed = {s.key for s in saves if s.key.kind == EntryKind.WINDOW and s.level == 1 and s.from_level < 0}
    assert flushed == {TierKey(EntryKind.WINDOW, x) for x in a.block_hashes}


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(WINDOW_KINDS),
    policy=st.sampled_from(("align", "all", "recap")),
    block_size=st.sampled_from([1, 2, 4]),
    sliding_window=st.integers(1, 9),
    num_blocks=st.integers(3, 24),
    num_state_slots=st.integers(1, 8),
    host_entries=st.integers(0, 12),
    disk_entries=st.integers(0, 30),
    seed=st.integers(0, 2**31),
)
def test_blast_window_with_host_and_disk(kind: str, policy: str, block_size: int, sliding_window: int,
                                         num_blocks: int, num_state_slots: int, host_entries: int, disk_entries: int,
                                         seed: int) -> None:  # fmt: skip
    sched = make_scheduler(kind, policy, block_size, num_blocks, num_state_slots, 4, 24, 64,
                           cache_host_bytes=host_entries * 3, cache_disk_bytes=disk_entries * 3, kv_bytes_per_token=1,
                           state_bytes_per_slot=3, window_bytes_per_token=1, sliding_window=sliding_window)  # fmt: skip
    run_tier_blast(sched, seed)  # its checks count the window pool and the promotions' held window blocks
