"""The host-memory tier's store, runner side: entries as host tensors (pinned when the cache is on a GPU).

The cache core decides what goes here, what moves down to the disk tier and what is read back
(recap/core/tiers.py); this store only holds the rows. Copies are synchronous within the step: a save is
readable as soon as the step reports it, and a load's rows are in their block or slot before the report.
On a CPU server the read pools are host RAM too; the tier is still its own byte budget and index, so the
read pools stay the size the memory plan gave them.
"""

from __future__ import annotations

from dataclasses import dataclass

from recap.core.tier_index import EntryKind, TierKey
from recap.model.cache import ModelCaches
from recap.runner.tier_rows import Rows, copy_in, entry_tensors


@dataclass
class HostTierStats:
    entries: int = 0
    bytes: int = 0  # payload bytes held now
    entries_written: int = 0
    entries_read: int = 0


class HostTier:
    """A dict of entries' rows. Main thread only."""

    def __init__(self, caches: ModelCaches) -> None:
        self.caches = caches
        rows = [t for kind in EntryKind for _, t in entry_tensors(caches, TierKey(kind, 0), 0)]
        self.pin = any(t.is_cuda for t in rows)  # device -> pinned host memory, the fast path over PCIe
        self.stats = HostTierStats()
        self._entries: dict[TierKey, Rows] = {}

    def put(self, key: TierKey, rows: Rows) -> None:
        self.drop(key)
        self._entries[key] = rows
        self.stats.entries += 1
        self.stats.bytes += sum(t.nbytes for _, t in rows)
        self.stats.entries_written += 1

    def get(self, key: TierKey) -> Rows | None:
        return self._entries.get(key)

    def drop(self, key: TierKey) -> None:
        rows = self._entries.pop(key, None)
        if rows is not None:
            self.stats.entries -= 1
            self.stats.bytes -= sum(t.nbytes for _, t in rows)

    def read_into(self, key: TierKey, index: int) -> bool:
        """Copy the entry into block or slot `index`; False when it is not held or does not fit."""
        rows = self._entries.get(key)
        if rows is None or not copy_in(self.caches, key, index, rows):
            return False
        self.stats.entries_read += 1
        return True
