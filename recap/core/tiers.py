"""Demotion and promotion between the read pools and an ordered list of lower tiers (host memory, then disk).
Integer bookkeeping; each tier's entries, budget and LRU order are its `TierIndex`.

Demotion: when the KV pool evicts a hashed block, or the state pool evicts a checkpoint (or drops one
whose KV block was just demoted), the manager orders a save into the first tier (`TierSave`: the key, the
tier, and the block or slot that still holds the data) and reserves the entry PENDING there. What that tier
evicts for room (its least recently used READY entries) moves one tier down: a save from the tier's copy
into the next tier and a drop of the copy (`TierDrop`); what the last tier evicts is gone. A tier full of
entries that cannot be evicted passes the entry to the next. The runner snapshots every save of a step
before that step's drops, state copies and forward pass (which may delete the copy or reuse the block or
slot), writes it, and reports it (READY). A PENDING entry is readable already: each store runs its orders in
order, so a load ordered after the save reads it wherever the writes are (core/tier_index.py).

Promotion: a waiting request whose hit the tiers make deeper (KV for every block up to n from the read
pool or a tier, and a checkpoint at n from either, each read from the fastest tier holding it) leaves the
waiting queue while the runner loads those entries into fresh blocks and a PENDING slot (`TierLoad`, with
each entry's tier); other requests keep running. The read pool blocks of its prefix are held meanwhile so
the loaded ones join a prefix that is still there. When the runner reports the load, the loaded blocks are
registered by hash (a leading run only: a block after a failed one would not be reachable), the checkpoint
through the state pool's provenance-checked registration, and the request returns to the head of the
waiting queue, where `find_hit` sees them like any cached entry. A failed or corrupt entry is forgotten and
the hit falls back to the deepest consistent point the pools hold (or to recompute): never a failed
request. A request promotes at most once per admission, so eviction under pressure cannot loop it.

An entry is in at most one tier. A promoted entry stays in its tier (deliberately duplicated with the read
pool): evicted again from the read pool it needs no second write. Only `flush` (a clean shutdown) copies
entries into the last tier, the persistent one, while a faster tier keeps them too. Models with a
sliding-window group have no tier yet (its blocks are not saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.output import CheckpointWrite, SchedulerOutput, TierDrop, TierLoad, TierLoadReport, TierSave, TierSaved
from recap.core.policy import Source
from recap.core.request import Request
from recap.core.state_pool import PlannedWrite
from recap.core.tier_index import EntryKind, TierIndex, TierKey


class Promotion(NamedTuple):
    """A request's load in flight: what it reads, where to, and the read-pool blocks it holds meanwhile."""

    load: TierLoad
    held_blocks: tuple[int, ...]  # prefix blocks (touched) then the destination blocks, in table order


@dataclass
class TierManager:
    """Lower tiers (fastest first) under a CacheManager. Side effects: on the cache's pools (holds, registration)."""

    cache: CacheManager
    indexes: list[TierIndex]
    kv_entry_bytes: int
    checkpoint_entry_bytes: int
    disabled: set[int] = field(default_factory=set)  # tiers whose store turned itself off
    saves: list[TierSave] = field(default_factory=list)  # ordered since the last step was scheduled
    drops: list[TierDrop] = field(default_factory=list)
    promoting: dict[str, Promotion] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # promoted once since their last admission

    def __post_init__(self) -> None:
        cache = self.cache
        if not self.indexes:
            raise ValueError("a TierManager needs at least one tier")
        if cache.window is not None:
            raise ValueError("cache tiers do not support models with sliding-window attention layers yet")
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

    def entry_bytes(self, key: TierKey) -> int:
        return self.kv_entry_bytes if key.kind == EntryKind.KV else self.checkpoint_entry_bytes

    # -- demotion -----------------------------------------------------------------------------
    def demote_kv(self, block_id: int, block_hash: int) -> None:
        self._demote(TierKey(EntryKind.KV, block_hash), block_id)

    def demote_checkpoint(self, slot: int, block_hash: int, position: int, stranded: bool) -> None:
        """A checkpoint leaves the state pool; `stranded`: because its KV block left, kept only if that was demoted."""
        if stranded and not self.has_kv(block_hash):
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
        kv, state = self.cache.kv, self.cache.state
        if kv is not None:
            for block_hash in kv.pool.cached_hashes(kv.pool.num_cached):
                block_id = kv.pool.lookup(block_hash)
                assert block_id is not None
                self._copy_down(TierKey(EntryKind.KV, block_hash), -1, block_id)
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

    # -- promotion ------------------------------------------------------------------------------
    def _kv_level(self, block_hash: int) -> int | None:
        return next((i for i, t in enumerate(self.indexes) if t.kv_readable(block_hash)), None)

    def _checkpoint_entry(self, block_hash: int) -> tuple[TierKey, int] | None:
        for i, t in enumerate(self.indexes):
            key = t.checkpoint_key(block_hash)
            if key is not None:
                return key, i
        return None

    def plan(self, request: Request, hit: CacheHit) -> TierLoad | None:
        """A load that makes the request's hit deeper than `hit`, with its blocks and slot taken; None if none."""
        cache = self.cache
        if not self.enabled or request.request_id in self.tried or request.prompt_logprobs or not cache.enable_caching:
            return None
        bs, hashes = cache.block_size, request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        kv_len = hit.kv_hit_tokens // bs if cache.kv is not None else max_blocks
        ext = kv_len
        if cache.kv is not None:
            while ext < max_blocks and self._kv_level(hashes[ext]) is not None:
                ext += 1
        target, cp = self._deepest_checkpoint(hashes, ext, hit.num_tokens // bs)
        if target * bs <= hit.num_tokens:
            return None
        return self._allocate(request, kv_len, target, cp)

    def _deepest_checkpoint(self, hashes: list[int], ext: int, best: int) -> tuple[int, tuple[TierKey, int] | None]:
        """(k, (tier key, tier); None: a read-pool one) of the deepest checkpoint in (best, ext]; (ext, None) without
        state."""
        state = self.cache.state
        if state is None:
            return ext, None
        if not state.enable_caching:
            return 0, None
        for k in range(ext, best, -1):
            if state.pool.lookup(hashes[k - 1]) is not None:
                return k, None
            found = self._checkpoint_entry(hashes[k - 1])
            if found is not None:
                return k, found
        return 0, None

    def _allocate(self, request: Request, kv_len: int, target: int, cp: tuple[TierKey, int] | None) -> TierLoad | None:
        cache, hashes = self.cache, request.block_hashes
        kv, state = cache.kv, cache.state
        prefix: list[int] = []
        if kv is not None:
            prefix = kv.find_prefix(hashes, min(kv_len, target))
            if target - len(prefix) > kv.pool.num_free - kv.pool.num_free_among(prefix):
                return None
        keys = [TierKey(EntryKind.KV, h) for h in hashes[len(prefix) : target]] if kv is not None else []
        pinned = [(key, self._kv_level(key.block_hash)) for key in keys] + ([cp] if cp is not None else [])
        for key, level in pinned:  # first: the allocations below demote, and a demotion may evict tier entries
            self.indexes[level].pin(key)  # type: ignore[index]
        checkpoint = None
        if cp is not None:
            assert state is not None
            slot = state.pool.allocate_checkpoint(cp[0].position, proven=True)
            if slot is None:
                for key, level in pinned:
                    self.indexes[level].unpin(key)  # type: ignore[index]
                return None
            checkpoint = (cp[0], slot)
        blocks: list[int] = []
        if kv is not None:
            kv.pool.touch(prefix)
            blocks = kv.pool.allocate(len(keys))
        for key, level in pinned:
            self.indexes[level].touch(key)  # type: ignore[index]
            self.indexes[level].counters.hits += 1  # type: ignore[index]
        levels = tuple(level for _, level in pinned)
        load = TierLoad(request.request_id, tuple(zip(keys, blocks)), checkpoint, levels)  # type: ignore[arg-type]
        self.promoting[request.request_id] = Promotion(load, (*prefix, *blocks))
        self.tried.add(request.request_id)
        return load

    def complete(self, request: Request, report: TierLoadReport) -> None:
        """Register what the runner loaded (a leading run of KV blocks, the checkpoint if reported as planned)."""
        promotion = self.promoting.pop(request.request_id)
        load = promotion.load
        level_of = {key: level for key, _, level in load.entries()}
        for key, level in level_of.items():
            self.indexes[level].unpin(key)
        for key in report.failed:
            index = self.indexes[level_of[key]]
            index.counters.promotions_failed += 1
            if index.has(key) and not index.is_pinned(key):
                index.remove(key)
                self.drops.append(TierDrop(key, level_of[key]))
        loaded = set(report.loaded)
        num_ok = 0
        while num_ok < len(load.kv) and load.kv[num_ok][0] in loaded:
            num_ok += 1
        kv, state = self.cache.kv, self.cache.state
        if kv is not None and num_ok:
            kv.pool.cache_blocks([b for _, b in load.kv[:num_ok]], [k.block_hash for k, _ in load.kv[:num_ok]])
        promoted = [key for key, _ in load.kv[:num_ok]]
        if load.checkpoint is not None:
            assert state is not None
            (key, slot), written = load.checkpoint, report.checkpoint
            write = CheckpointWrite(key.position, slot)
            plan = PlannedWrite(write, key.block_hash, False, True, Source.TIER, key.position)
            reports = [written] if written is not None and key in loaded else []
            promoted += [key] * sum(state.pool.register([plan], reports, request.block_hashes))
        for key in promoted:
            counters = self.indexes[level_of[key]].counters
            counters.promotions += 1
            counters.loaded_bytes += self.entry_bytes(key)
        if kv is not None:
            kv.pool.free(promotion.held_blocks)

    def cancel(self, request_id: str) -> None:
        """The request left while loading: release its holds (the runner discards the late data by request id)."""
        promotion = self.promoting.pop(request_id)
        load = promotion.load
        for key, _, level in load.entries():
            self.indexes[level].unpin(key)
        if self.cache.kv is not None:
            self.cache.kv.pool.free(promotion.held_blocks)
        if load.checkpoint is not None:
            assert self.cache.state is not None
            self.cache.state.pool.free(load.checkpoint[1])

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
