"""Demotion and promotion between the read pools and a lower tier (the disk tier). Integer bookkeeping.

Demotion: when the KV pool evicts a hashed block, or the state pool evicts a checkpoint (or drops one
whose KV block was just demoted), the manager orders a save (`TierSave`: the key and the block or slot
that still holds the data) and reserves the entry PENDING in its `TierIndex`. The runner snapshots every
save of a step before that step's state copies and forward pass reuse the block or slot, writes it in
the background, and reports it; only then is the entry READY (readable). Evicting READY entries to make
room orders their files deleted (`tier_drops`).

Promotion: a waiting request whose hit the tier makes deeper (KV for every block up to n from the read
pool or the tier, and a checkpoint at n from either) leaves the waiting queue while the runner loads
those entries into fresh blocks and a PENDING slot (`TierLoad`); other requests keep running. The read
pool blocks of its prefix are held meanwhile so the loaded ones join a prefix that is still there. When the
runner reports the load, the loaded blocks are registered by hash (a leading run only: a block after a
failed one would not be reachable), the checkpoint through the state pool's provenance-checked
registration, and the request returns to the head of the waiting queue, where `find_hit` sees them like
any cached entry. A failed or corrupt entry is forgotten and the hit falls back to the deepest consistent
point the pools hold (or to recompute): never a failed request. A request promotes at most once per
admission, so eviction under pressure cannot loop it.

A promoted entry stays in the tier (deliberately duplicated): evicted again from the read pool it needs
no second write. Models with a sliding-window group have no tier yet (its blocks are not saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.output import CheckpointWrite, TierLoad, TierLoadReport, TierSave
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
    """One lower tier under a CacheManager. Side effects: on the cache's pools (holds, registration)."""

    cache: CacheManager
    index: TierIndex
    kv_entry_bytes: int
    checkpoint_entry_bytes: int
    enabled: bool = True
    saves: list[TierSave] = field(default_factory=list)  # ordered since the last step was scheduled
    drops: list[TierKey] = field(default_factory=list)
    promoting: dict[str, Promotion] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # promoted once since their last admission

    def __post_init__(self) -> None:
        cache = self.cache
        if cache.window is not None:
            raise ValueError("the disk tier does not support models with sliding-window attention layers yet")
        if cache.kv is not None:
            cache.kv.pool.on_spill = self.demote_kv
        if cache.state is not None:
            cache.state.pool.on_spill = self.demote_checkpoint

    # -- demotion -----------------------------------------------------------------------------
    def demote_kv(self, block_id: int, block_hash: int) -> None:
        self._demote(TierKey(EntryKind.KV, block_hash), block_id, self.kv_entry_bytes)

    def demote_checkpoint(self, slot: int, block_hash: int, position: int, stranded: bool) -> None:
        """A checkpoint leaves the state pool; `stranded`: because its KV block left, kept only if that was demoted."""
        if stranded and not self.index.has_kv(block_hash):
            return
        self._demote(TierKey(EntryKind.CHECKPOINT, block_hash, position), slot, self.checkpoint_entry_bytes)

    def _demote(self, key: TierKey, source: int, num_bytes: int) -> None:
        if not self.enabled or not self.cache.enable_caching:
            return
        if self.index.has(key):
            self.index.touch(key)
            return
        evicted = self.index.reserve(key, num_bytes)
        if evicted is not None:
            self.drops += evicted
            self.saves.append(TierSave(key, source))

    def flush(self) -> tuple[list[TierSave], list[TierKey]]:
        """At a clean shutdown: save orders for every cached KV block and checkpoint the tier lacks, so a restart
        finds what the read pools held too (the runner writes them before it stops)."""
        kv, state = self.cache.kv, self.cache.state
        if kv is not None:
            for block_hash in kv.pool.cached_hashes(kv.pool.num_cached):
                block_id = kv.pool.lookup(block_hash)
                assert block_id is not None
                self.demote_kv(block_id, block_hash)
        if state is not None:
            for block_hash, position in state.pool.checkpoint_keys(state.pool.num_checkpoints):
                slot = state.pool.lookup(block_hash)
                assert slot is not None
                self.demote_checkpoint(slot, block_hash, position, False)
        return self.take_orders()

    def take_orders(self) -> tuple[list[TierSave], list[TierKey]]:
        saves, drops, self.saves, self.drops = self.saves, self.drops, [], []
        return saves, drops

    def restore(self, keys: list[TierKey]) -> None:
        """Entries the store found on disk at start (oldest first): READY; past the budget the oldest are dropped."""
        for key in keys:
            num_bytes = self.kv_entry_bytes if key.kind == EntryKind.KV else self.checkpoint_entry_bytes
            if self.index.has(key):
                continue
            evicted = self.index.add_ready(key, num_bytes)
            self.drops += [key] if evicted is None else evicted

    # -- promotion ------------------------------------------------------------------------------
    def plan(self, request: Request, hit: CacheHit) -> TierLoad | None:
        """A load that makes the request's hit deeper than `hit`, with its blocks and slot taken; None if none."""
        cache, index = self.cache, self.index
        if not self.enabled or request.request_id in self.tried or request.prompt_logprobs or not cache.enable_caching:
            return None
        bs, hashes = cache.block_size, request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        kv_len = hit.kv_hit_tokens // bs if cache.kv is not None else max_blocks
        ext = kv_len
        if cache.kv is not None:
            while ext < max_blocks and index.kv_ready(hashes[ext]):
                ext += 1
        target, cp_key = self._deepest_checkpoint(hashes, ext, hit.num_tokens // bs)
        if target * bs <= hit.num_tokens:
            return None
        return self._allocate(request, kv_len, target, cp_key)

    def _deepest_checkpoint(self, hashes: list[int], ext: int, best: int) -> tuple[int, TierKey | None]:
        """(k, tier key; None: a read-pool one) of the deepest checkpoint in (best, ext]; (ext, None) without state."""
        state = self.cache.state
        if state is None:
            return ext, None
        if not state.enable_caching:
            return 0, None
        for k in range(ext, best, -1):
            if state.pool.lookup(hashes[k - 1]) is not None:
                return k, None
            key = self.index.checkpoint_key(hashes[k - 1])
            if key is not None:
                return k, key
        return 0, None

    def _allocate(self, request: Request, kv_len: int, target: int, cp_key: TierKey | None) -> TierLoad | None:
        cache, hashes, index = self.cache, request.block_hashes, self.index
        kv, state = cache.kv, cache.state
        prefix: list[int] = []
        if kv is not None:
            prefix = kv.find_prefix(hashes, min(kv_len, target))
            if target - len(prefix) > kv.pool.num_free - kv.pool.num_free_among(prefix):
                return None
        keys = [TierKey(EntryKind.KV, h) for h in hashes[len(prefix) : target]] if kv is not None else []
        pinned = keys + ([cp_key] if cp_key is not None else [])
        for key in pinned:  # first: the allocations below demote, and a demotion may evict tier entries
            index.pin(key)
        checkpoint = None
        if cp_key is not None:
            assert state is not None
            slot = state.pool.allocate_checkpoint(cp_key.position, proven=True)
            if slot is None:
                for key in pinned:
                    index.unpin(key)
                return None
            checkpoint = (cp_key, slot)
        blocks: list[int] = []
        if kv is not None:
            kv.pool.touch(prefix)
            blocks = kv.pool.allocate(len(keys))
        for key in pinned:
            index.touch(key)
        index.counters.hits += len(pinned)
        load = TierLoad(request.request_id, tuple(zip(keys, blocks)), checkpoint)
        self.promoting[request.request_id] = Promotion(load, (*prefix, *blocks))
        self.tried.add(request.request_id)
        return load

    @staticmethod
    def _keys(load: TierLoad) -> list[TierKey]:
        keys = [key for key, _ in load.kv]
        return keys + [load.checkpoint[0]] if load.checkpoint is not None else keys

    def complete(self, request: Request, report: TierLoadReport) -> None:
        """Register what the runner loaded (a leading run of KV blocks, the checkpoint if reported as planned)."""
        promotion = self.promoting.pop(request.request_id)
        load, index = promotion.load, self.index
        for key in self._keys(load):
            index.unpin(key)
        for key in report.failed:
            if index.has(key) and not index.is_pinned(key):
                index.remove(key)
                self.drops.append(key)
        loaded = set(report.loaded)
        num_ok = 0
        while num_ok < len(load.kv) and load.kv[num_ok][0] in loaded:
            num_ok += 1
        kv, state = self.cache.kv, self.cache.state
        if kv is not None and num_ok:
            kv.pool.cache_blocks([b for _, b in load.kv[:num_ok]], [k.block_hash for k, _ in load.kv[:num_ok]])
        promoted = num_ok
        if load.checkpoint is not None:
            assert state is not None
            (key, slot), written = load.checkpoint, report.checkpoint
            write = CheckpointWrite(key.position, slot)
            plan = PlannedWrite(write, key.block_hash, False, True, Source.TIER, key.position)
            reports = [written] if written is not None and key in loaded else []
            promoted += sum(state.pool.register([plan], reports, request.block_hashes))
        index.counters.promotions += promoted
        index.counters.promotions_failed += len(report.failed)
        if kv is not None:
            kv.pool.free(promotion.held_blocks)

    def cancel(self, request_id: str) -> None:
        """The request left while loading: release its holds (the runner discards the late data by request id)."""
        promotion = self.promoting.pop(request_id)
        load = promotion.load
        for key in self._keys(load):
            self.index.unpin(key)
        if self.cache.kv is not None:
            self.cache.kv.pool.free(promotion.held_blocks)
        if load.checkpoint is not None:
            assert self.cache.state is not None
            self.cache.state.pool.free(load.checkpoint[1])

    # -- runner reports -------------------------------------------------------------------------
    def saved(self, results: list[tuple[TierKey, bool]]) -> None:
        for key, ok in results:
            if not self.index.has(key):
                continue  # forgotten meanwhile (a reset)
            if ok:
                self.index.mark_ready(key)
            else:
                self.index.remove(key)
                self.index.counters.saves_failed += 1

    def disable(self) -> None:
        """The runner turned its store off (unwritable, full): forget the tier; nothing more is saved."""
        self.enabled = False
        self.index.clear()
