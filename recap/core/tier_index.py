"""What a lower cache tier (disk; on a GPU server also host memory) holds, in integers. No torch, no I/O.

One `TierIndex` per tier. It is the cache core's record of the tier: which entries exist, their bytes,
the tier's byte budget and its eviction order. The copies themselves belong to the runner (and its I/O
thread); the index only says what to copy and what may be read.

Entries:
  KV block:     key (KV, chain hash h[k], 0): the full-attention KV of token block k (all those layers);
  window block: key (WINDOW, h[k], 0): the sliding-window layers' KV of token block k (their own pool);
  checkpoint:   key (CHECKPOINT, h[k], (k + 1) * block_size): the recurrent state after those tokens.
The chain hash already covers the cache salt and extra keys (core/hashing.py), so equal keys mean equal
content for one model; the runner keeps each model identity in its own directory.

States of an entry:
  PENDING: a save order was issued; the bytes are reserved. Readable: each store runs its orders in the
           order given (the host store at once, the disk store in one FIFO I/O thread), so a load ordered
           after the save reads what it wrote, however far behind the writes are. Not evictable.
  READY:   the runner reported it written. Evictable unless pinned (a load from it is in flight).
  failed:  the runner reported the save unwritten while a load had it pinned: no longer readable, forgotten
           at its last unpin (that load fails and falls back).
So a hit never depends on how fast a store writes, and an entry is never deleted under a read.

Eviction order: least recently used first (`touch` on every hit and every repeated demotion). The read
pool above already chose what to drop by value (GreedyDual for checkpoints, 2Q for KV), so what reaches a
lower tier is what the read pool valued least; a second value order here would rank entries already
ranked low. LRU is simple, O(1), and the replay can compare others against it.

API (stable; the trace replay models tiers with it): `reserve` (a save order: PENDING, evicting READY
LRU entries as needed; returns the evicted keys, or None when it does not fit), `mark_ready`, `remove`,
`add_ready` (entries found on disk at start), `fail`, `is_ready` / `has` / `has_kv` / `kv_readable` / `has_block` /
`block_readable` / `checkpoint_key` / `is_pinned` / `iter_keys`, `touch`, `pin` / `unpin`, `check` (accounting, for
core/integrity.py).
Counters (`TierCounters`): demotions, hits, promotions, evictions, failed saves and loads.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple


class EntryKind(enum.IntEnum):
    KV = 0
    CHECKPOINT = 1
    WINDOW = 2


BLOCK_KINDS = (EntryKind.KV, EntryKind.WINDOW)  # entries keyed by a block hash alone, one per block group


class TierKey(NamedTuple):
    """An entry: its kind, the chain hash of the block it ends on, and (checkpoints) its position in tokens."""

    kind: EntryKind
    block_hash: int
    position: int = 0


@dataclass
class TierEntry:
    num_bytes: int
    ready: bool = False
    pins: int = 0
    failed: bool = False  # its save was reported unwritten while pinned


@dataclass
class TierCounters:
    demotions: int = 0  # entries reserved for a save (read pool -> tier)
    demotions_declined: int = 0  # saves not ordered: the tier is full of entries that cannot be evicted
    saves_failed: int = 0  # saves the runner reported unwritten
    hits: int = 0  # entries a hit planned to read
    promotions: int = 0  # entries read back and registered in the read pool
    promotions_failed: int = 0  # loads the runner reported failed (missing, corrupt, foreign)
    evictions: int = 0  # READY entries dropped to make room
    stored_bytes: int = 0  # bytes of the saves ordered from the read pools (not from a faster tier)
    loaded_bytes: int = 0  # bytes of the entries promoted into the read pools


class TierIndex:
    """A tier's entries, byte budget and LRU order. Side effects: only on itself."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"tier {name}: budget must be >= 0 bytes, got {budget_bytes}")
        self.name = name
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[TierKey, TierEntry] = OrderedDict()  # LRU first
        # hashes of each block group's entries (ready or pending), for O(1) chain walks
        self._blocks: dict[EntryKind, set[int]] = {kind: set() for kind in BLOCK_KINDS}
        self._checkpoints: dict[int, int] = {}  # hash -> position of checkpoint entries (ready or pending)
        self.num_bytes = 0
        self.counters = TierCounters()

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_ready(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready)

    def __contains__(self, key: TierKey) -> bool:
        return key in self._entries

    def iter_keys(self) -> Iterator[TierKey]:
        return iter(self._entries)

    # -- lookup -------------------------------------------------------------------------------
    def has(self, key: TierKey) -> bool:
        """Held, ready or pending (a demotion need not be ordered again)."""
        return key in self._entries

    def is_ready(self, key: TierKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def is_pinned(self, key: TierKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    def has_kv(self, block_hash: int) -> bool:
        return block_hash in self._blocks[EntryKind.KV]

    def has_block(self, kind: EntryKind, block_hash: int) -> bool:
        """A KV or window entry for this hash is held (ready or pending)."""
        return block_hash in self._blocks[kind]

    def readable(self, key: TierKey) -> bool:
        """A load ordered now reads it: held, ready or pending, and its save not reported failed."""
        entry = self._entries.get(key)
        return entry is not None and not entry.failed

    def kv_readable(self, block_hash: int) -> bool:
        return self.readable(TierKey(EntryKind.KV, block_hash))

    def block_readable(self, kind: EntryKind, block_hash: int) -> bool:
        return self.readable(TierKey(kind, block_hash))

    def checkpoint_key(self, block_hash: int) -> TierKey | None:
        """The readable checkpoint entry keyed by this hash, if any."""
        position = self._checkpoints.get(block_hash)
        if position is None:
            return None
        key = TierKey(EntryKind.CHECKPOINT, block_hash, position)
        return key if self.readable(key) else None

    # -- changes -------------------------------------------------------------------------------
    def touch(self, key: TierKey) -> None:
        """A hit or a repeated demotion: the entry becomes the most recently used."""
        self._entries.move_to_end(key)

    def reserve(self, key: TierKey, num_bytes: int) -> list[TierKey] | None:
        """Order a save: add `key` PENDING with its bytes, evicting READY unpinned entries LRU first.

        Returns the evicted keys (their files are to be deleted), or None when it cannot fit (nothing is
        changed then). `key` must not be held.
        """
        assert key not in self._entries, f"tier {self.name}: {key} reserved twice"
        need = self.num_bytes + num_bytes - self.budget_bytes
        victims: list[TierKey] = []
        if need > 0:
            for k, e in self._entries.items():
                if e.ready and not e.pins:
                    victims.append(k)
                    need -= e.num_bytes
                    if need <= 0:
                        break
            if need > 0:
                self.counters.demotions_declined += 1
                return None
        for k in victims:
            self.remove(k)
        self.counters.evictions += len(victims)
        self._insert(key, TierEntry(num_bytes))
        self.counters.demotions += 1
        return victims

    def add_ready(self, key: TierKey, num_bytes: int) -> list[TierKey] | None:
        """An entry already written (found on disk at start): `reserve` then `mark_ready`."""
        evicted = self.reserve(key, num_bytes)
        if evicted is not None:
            self.counters.demotions -= 1  # not a demotion of this run
            self.mark_ready(key)
        return evicted

    def mark_ready(self, key: TierKey) -> None:
        """The runner reported the entry written."""
        entry = self._entries[key]
        assert not entry.ready, f"tier {self.name}: {key} written twice"
        entry.ready = True

    def fail(self, key: TierKey) -> None:
        """The runner reported the save unwritten: forget the entry, or, while a load reads it, once that ends."""
        entry = self._entries[key]
        assert not entry.ready, f"tier {self.name}: {key} failed after it was written"
        self.counters.saves_failed += 1
        if entry.pins:
            entry.failed = True
        else:
            self.remove(key)

    def remove(self, key: TierKey) -> None:
        """Forget an entry (a failed save, a failed load, an eviction)."""
        entry = self._entries.pop(key)
        assert not entry.pins, f"tier {self.name}: {key} removed while a load reads it"
        self.num_bytes -= entry.num_bytes
        if key.kind == EntryKind.CHECKPOINT:
            del self._checkpoints[key.block_hash]
        else:
            self._blocks[key.kind].discard(key.block_hash)

    def pin(self, key: TierKey) -> None:
        entry = self._entries[key]
        assert not entry.failed, f"tier {self.name}: pin of {key}, whose save failed"
        entry.pins += 1

    def unpin(self, key: TierKey) -> None:
        entry = self._entries[key]
        assert entry.pins > 0, f"tier {self.name}: unpin of unpinned {key}"
        entry.pins -= 1
        if entry.failed and not entry.pins:
            self.remove(key)

    def clear(self) -> list[TierKey]:
        """Forget every unpinned entry (the tier was turned off); returns the keys forgotten."""
        keys = [k for k, e in self._entries.items() if not e.pins]
        for k in keys:
            self.remove(k)
        return keys

    def _insert(self, key: TierKey, entry: TierEntry) -> None:
        self._entries[key] = entry
        self.num_bytes += entry.num_bytes
        if key.kind != EntryKind.CHECKPOINT:
            self._blocks[key.kind].add(key.block_hash)
        else:
            assert key.block_hash not in self._checkpoints, f"tier {self.name}: two checkpoints keyed {key}"
            self._checkpoints[key.block_hash] = key.position

    # -- integrity -------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert bytes, maps and budget agree. O(entries): for tests."""
        assert self.num_bytes == sum(e.num_bytes for e in self._entries.values()), f"tier {self.name}: bytes drift"
        assert self.num_bytes <= self.budget_bytes, f"tier {self.name}: {self.num_bytes} B over its budget"
        for kind in BLOCK_KINDS:
            hashes = {k.block_hash for k in self._entries if k.kind == kind}
            assert hashes == self._blocks[kind], f"tier {self.name}: {kind.name} hash set disagrees with its entries"
        cps = {k.block_hash: k.position for k in self._entries if k.kind == EntryKind.CHECKPOINT}
        assert cps == self._checkpoints, f"tier {self.name}: checkpoint map disagrees with its entries"
        for key, e in self._entries.items():
            assert e.num_bytes >= 0 and e.pins >= 0, f"tier {self.name}: {key} {e}"
            assert not (e.ready and e.failed), f"tier {self.name}: {key} both written and failed"
            assert e.pins or not e.failed, f"tier {self.name}: failed {key} outlived its loads"
