"""Demotion and promotion between the read pools and an ordered list of lower tiers (host memory, then disk).
Integer bookkeeping; each tier's entries, budget and LRU order are its `TierIndex`.

Entries: a KV block, a window block (the sliding-window layers' KV of one block, over their own pool) and a
checkpoint (core/tier_index.py).

Demotion: when the KV or window pool evicts a hashed block, or the state pool evicts a checkpoint (or drops
one stranded by its block's eviction: kept only while every block group still holds that block, in its read
pool or a tier), the manager orders a save into the first tier (`TierSave`: the key, the tier, and the block
or slot that still holds the data) and reserves the entry PENDING there. What that tier evicts for room (its
least recently used READY entries) moves one tier down: a save from the tier's copy into the next tier and a
drop of the copy (`TierDrop`); what the last tier evicts is gone. A tier full of entries that cannot be
evicted passes the entry to the next. The runner snapshots every save of a step before that step's drops,
state copies and forward pass (which may delete the copy or reuse the block or slot), writes it, and reports
it (READY). A PENDING entry is readable already: each store runs its orders in order, so a load ordered after
the save reads it wherever the writes are (core/tier_index.py).

Promotion (core/tier_promotion.py): a waiting request whose hit the tiers make deeper (every cache group's
part of a hit at n from the read pools or a tier: KV blocks up to n, a checkpoint at n, the window blocks
before n) leaves the waiting queue while the runner loads those entries into fresh blocks and a PENDING slot
(`TierLoad`); other requests keep running. When the runner reports the load, what it loaded is registered and
the request returns to the head of the waiting queue, where `find_hit` sees it like any cached entry. A failed
or corrupt entry is forgotten and the hit falls back to the deepest consistent point the pools hold (or to
recompute): never a failed request. A request promotes at most once per admission, so eviction under
pressure cannot loop it.

An entry is in at most one tier. A promoted entry stays in its tier (deliberately duplicated with the read
pool): evicted again from the read pool it needs no second write. Only `flush` (a clean shutdown) copies
entries into the last tier, the persistent one, while a faster tier keeps them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recap.core.block_pool import BlockPool
from recap.core.cache_manager import CacheManager
from recap.core.output import SchedulerOutput, TierDrop, TierSave, TierSaved
from recap.core.policy import Source
from recap.core.tier_index import EntryKind, TierIndex, TierKey
from recap.core.tier_promotion import Promotion, TierPromotion

__all__ = ["Promotion", "TierManager"]


@dataclass
class TierManager(TierPromotion):
    """Lower tiers (fastest first) under a CacheManager. Side effects: on the cache's pools (holds, registration)."""

    cache: CacheManager
    indexes: list[TierIndex]
    kv_entry_bytes: int
    checkpoint_entry_bytes: int
    window_entry_bytes: int = 1  # the window layers' rows of one block (unused without a window group)
    disabled: set[int] = field(default_factory=set)  # tiers whose store turned itself off
    saves: list[TierSave] = field(default_factory=list)  # ordered since the last step was scheduled
    drops: list[TierDrop] = field(default_factory=list)
    promoting: dict[str, Promotion] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # promoted once since their last admission

    def __post_init__(self) -> None:
        cache = self.cache
        if not self.indexes:
            raise ValueError("a TierManager needs at least one tier")
        if cache.window is not None and cache.window.span:  # span 0: a hit reads no window block before it
            cache.window.pool.on_spill = self.demote_window
        if cache.kv is not None:
            cache.kv.pool.on_spill = self.demote_kv
            cache.lower_kv = self.has_kv  # a block only in a tier still ends a KV hit: the tail learner keeps it
        if cache.state is not None:
            cache.state.pool.on_spill = self.demote_checkpoint
            cache.state.write_through = frozenset({Source.LADDER})  # the tiers' own budget: straight down
        self._size_ladder()

    def _size_ladder(self) -> None:
        """The policy's tail ladder is budgeted by the checkpoints the enabled tiers can hold (core/policy.py)."""
        budget = sum(t.budget_bytes for i, t in enumerate(self.indexes) if i not in self.disabled)
        self.cache.policy.tier_capacity = budget // max(1, self.checkpoint_entry_bytes) if self.cache.state else 0

    @property
    def enabled(self) -> bool:
        return len(self.disabled) < len(self.indexes)

    def tier(self, name: str) -> TierIndex:
        return next(t for t in self.indexes if t.name == name)

    def level_of(self, key: TierKey) -> int | None:
        """The tier holding `key` (ready or pending), if any."""
        return next((i for i, t in enumerate(self.indexes) if t.has(key)), None)

    def has_kv(self, block_hash: int) -> bool:
        return any(t.has_kv(block_hash) for t in self.indexes)

    def has_block(self, kind: EntryKind, block_hash: int) -> bool:
        return any(t.has_block(kind, block_hash) for t in self.indexes)

    def entry_bytes(self, key: TierKey) -> int:
        if key.kind == EntryKind.KV:
            return self.kv_entry_bytes
        return self.window_entry_bytes if key.kind == EntryKind.WINDOW else self.checkpoint_entry_bytes

    def _block_groups(self) -> list[tuple[EntryKind, BlockPool]]:
        """Each block group's entry kind and read pool (the window group where a hit reads its blocks)."""
        kv, window = self.cache.kv, self.cache.window
        groups = [(EntryKind.KV, kv.pool)] if kv is not None else []
        return groups + ([(EntryKind.WINDOW, window.pool)] if window is not None and window.span else [])

    # -- demotion -----------------------------------------------------------------------------
    def demote_kv(self, block_id: int, block_hash: int) -> None:
        self._demote(TierKey(EntryKind.KV, block_hash), block_id)

    def demote_window(self, block_id: int, block_hash: int) -> None:
        self._demote(TierKey(EntryKind.WINDOW, block_hash), block_id)

    def demote_checkpoint(self, slot: int, block_hash: int, position: int, stranded: bool) -> None:
        """A checkpoint leaves the state pool; `stranded`: because the block it ends on left a block group's pool,
        kept only if every block group still holds that block (the one that left was demoted, the others are in
        their read pool or a tier): a hit there needs them all."""
        if stranded and not all(pool.lookup(block_hash) is not None or self.has_block(kind, block_hash)
                                for kind, pool in self._block_groups()):  # fmt: skip
            return
        self._demote(TierKey(EntryKind.CHECKPOINT, block_hash, position), slot)

    def _demote(self, key: TierKey, source: int) -> None:
        if not self.enabled or not self.cache.enable_caching:
            return
        level = self.level_of(key)
        if level is not None:
            self.indexes[level].touch(key)
            return
        self._place(key, 0, -1, source)

    def _place(self, key: TierKey, level: int, from_level: int, source: int) -> None:
        """Reserve `key` in the first tier from `level` down that takes it; what that tier evicts moves one down."""
        for lv in range(level, len(self.indexes)):
            if lv in self.disabled:
                continue
            evicted = self.indexes[lv].reserve(key, self.entry_bytes(key))
            if evicted is None:
                continue  # full of entries being written or read: the next tier may take it
            self._order_save(TierSave(key, source, lv, from_level))
            for victim in evicted:
                self.drops.append(TierDrop(victim, lv))
                self._place(victim, lv + 1, lv, 0)
            return

    def flush(self) -> tuple[list[TierSave], list[TierDrop]]:
        """At a clean shutdown: save orders into the last (persistent) tier for every entry it lacks, from the faster
        tiers and the read pools, so a restart finds them (the runner writes them before it stops)."""
        last = len(self.indexes) - 1
        for level, index in enumerate(self.indexes[:last]):
            for key in [k for k in index.iter_keys() if index.is_ready(k)]:
                self._copy_down(key, level, 0)  # deliberately duplicated: the faster tier ends with the process
        for kind, pool in self._block_groups():
            for block_hash in pool.cached_hashes(pool.num_cached):
                block_id = pool.lookup(block_hash)
                assert block_id is not None
                self._copy_down(TierKey(kind, block_hash), -1, block_id)
        state = self.cache.state
        if state is not None:
            for block_hash, position in state.pool.checkpoint_keys(state.pool.num_checkpoints):
                slot = state.pool.lookup(block_hash)
                assert slot is not None
                self._copy_down(TierKey(EntryKind.CHECKPOINT, block_hash, position), -1, slot)
        return self.take_orders()

    def _copy_down(self, key: TierKey, from_level: int, source: int) -> None:
        last = len(self.indexes) - 1
        index = self.indexes[last]
        if last in self.disabled or not self.cache.enable_caching or index.has(key):
            return
        if from_level < 0 and self.level_of(key) is not None:
            return  # a faster tier's copy is copied down already
        evicted = index.reserve(key, self.entry_bytes(key))
        if evicted is not None:
            self.drops += [TierDrop(k, last) for k in evicted]
            self._order_save(TierSave(key, source, last, from_level))

    def _order_save(self, save: TierSave) -> None:
        """The runner applies a step's saves before its drops: a drop of this entry from the same tier ordered
        earlier in the step (evicted, then demoted again) is void, the save overwrites it."""
        drop = TierDrop(save.key, save.level)
        if drop in self.drops:
            self.drops.remove(drop)
        if save.from_level < 0:
            self.indexes[save.level].counters.stored_bytes += self.entry_bytes(save.key)
        self.saves.append(save)

    def take_orders(self) -> tuple[list[TierSave], list[TierDrop]]:
        saves, drops, self.saves, self.drops = self.saves, self.drops, [], []
        return saves, drops

    def restore(self, keys: list[TierKey], level: int) -> None:
        """Entries tier `level`'s store found at start (oldest first): READY; past the budget the oldest are dropped."""
        index = self.indexes[level]
        for key in keys:
            if self.level_of(key) is not None:
                continue
            evicted = index.add_ready(key, self.entry_bytes(key))
            self.drops += [TierDrop(k, level) for k in ([key] if evicted is None else evicted)]

    def undo(self, out: SchedulerOutput) -> list[str]:
        """The runner raised on the step carrying these orders: any part may have run. Cancel its loads (their
        requests, returned, queue again), forget its saves and order their copies dropped with the step's drops
        (a store then holds at most what its index says; a write still queued is deleted after it, in order)."""
        rids = [load.request_id for load in out.tier_loads if load.request_id in self.promoting]
        for rid in rids:
            self.cancel(rid)
        for save in out.tier_saves:
            index = self.indexes[save.level]
            if index.has(save.key) and not index.is_ready(save.key):  # still this save's reservation
                index.fail(save.key)
                if not index.has(save.key):  # never under a read
                    self.drops.append(TierDrop(save.key, save.level))
        self.drops += [d for d in out.tier_drops if d not in self.drops and not self.indexes[d.level].has(d.key)]
        return rids

    # -- runner reports -------------------------------------------------------------------------
    def saved(self, results: list[TierSaved]) -> None:
        for key, ok, level in results:
            index = self.indexes[level]
            if not index.has(key) or index.is_ready(key):
                continue  # forgotten meanwhile (the store turned off)
            if ok:
                index.mark_ready(key)
            else:
                index.fail(key)

    def disable(self, level: int) -> None:
        """The runner turned tier `level`'s store off (unwritable, full): forget that tier; nothing more goes there."""
        self.disabled.add(level)
        self.indexes[level].clear()
        self._size_ladder()
