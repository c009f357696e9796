"""Promotion: a waiting request's hit made deeper by lower-tier entries (a mixin of `TierManager`, core/tiers.py).

A hit at k blocks needs every cache group (DESIGN section 1), each part from the read pools or a tier: the KV
blocks [0, k) with a full-attention group, the checkpoint after k blocks with a state group, and the window
blocks [k - span, k) with a sliding-window group (only the blocks inside the window before the hit;
core/window_manager.py). `plan` finds the deepest such k past the read pools' hit, each entry read from the
fastest tier holding it, and takes the destinations: fresh KV and window blocks and a PENDING slot
(`TierLoad`, with each entry's tier). The read-pool blocks the hit needs besides (the KV prefix, the window
blocks still cached) are held meanwhile, so what is loaded joins a prefix and a window that are still there.

`complete` registers what the runner loaded: a leading run of KV blocks (a block after a failed one would
not be reachable), every loaded window block (a window hit needs a run of them, found from the right, not a
prefix: each is findable on its own), the checkpoint through the state pool's provenance-checked
registration; then it releases the holds. `cancel` releases everything. A failed entry is forgotten; the
request, back at the head of the waiting queue, gets from `find_hit` the deepest point the pools now serve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.output import CheckpointWrite, TierDrop, TierLoad, TierLoadReport
from recap.core.policy import Source
from recap.core.request import Request
from recap.core.state_pool import PlannedWrite
from recap.core.tier_index import EntryKind, TierIndex, TierKey

Located = tuple[TierKey, int]  # an entry and the tier it is read from


class Promotion(NamedTuple):
    """A request's load in flight: what it reads, where to, and the read-pool blocks it holds meanwhile."""

    load: TierLoad
    held_blocks: tuple[int, ...]  # KV: prefix blocks (touched) then the destination blocks, in table order
    # Window blocks [k - span, k), in chain order: the cached ones (touched) and the destinations.
    held_window: tuple[int, ...] = ()
    target: int = 0  # k: the hit in blocks the load makes possible


class TierPromotion:
    """Mixed into TierManager, which provides these attributes."""

    cache: CacheManager
    indexes: list[TierIndex]
    drops: list[TierDrop]
    promoting: dict[str, Promotion]
    tried: set[str]
    enabled: bool
    entry_bytes: Callable[[TierKey], int]

    def block_level(self, kind: EntryKind, block_hash: int) -> int | None:
        """The fastest tier a KV or window block can be read from now, if any."""
        return next((i for i, t in enumerate(self.indexes) if t.block_readable(kind, block_hash)), None)

    def _checkpoint_entry(self, block_hash: int) -> Located | None:
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
            while ext < max_blocks and self.block_level(EntryKind.KV, hashes[ext]) is not None:
                ext += 1
        target, cp = self._deepest_target(hashes, ext, hit.num_tokens // bs)
        if target * bs <= hit.num_tokens:
            return None
        return self._allocate(request, kv_len, target, cp)

    def _deepest_target(self, hashes: Sequence[int], ext: int, best: int) -> tuple[int, Located | None]:
        """(k, the checkpoint's (tier key, tier), None: a read-pool one or no state group) for the deepest k in
        (best, ext] whose checkpoint and window blocks the read pools and tiers hold; (0, None) if none."""
        state = self.cache.state
        if state is not None and not state.enable_caching:
            return 0, None
        window_served = self._window_served(hashes, best, ext)
        for k in range(ext, best, -1):
            if not window_served(k):
                continue
            if state is None or state.pool.lookup(hashes[k - 1]) is not None:
                return k, None
            found = self._checkpoint_entry(hashes[k - 1])
            if found is not None:
                return k, found
        return 0, None

    def _window_served(self, hashes: Sequence[int], best: int, ext: int) -> Callable[[int], bool]:
        """For best < k <= ext: whether each window block a hit at k needs (the last min(k, span)) is in the window
        read pool or a tier. Always, without a window group. O(ext - best + span): runs of held blocks."""
        window = self.cache.window
        if window is None or not window.span:
            return lambda k: True
        span, lookup = window.span, window.pool.lookup
        lo = max(0, best + 1 - span)  # no k in range reads a block before it
        runs, run = [], 0  # runs[i - lo]: held blocks ending at block i
        for i in range(lo, ext):
            held = lookup(hashes[i]) is not None or self.block_level(EntryKind.WINDOW, hashes[i]) is not None
            run = run + 1 if held else 0
            runs.append(run)
        return lambda k: runs[k - 1 - lo] >= min(k, span)

    def _window_needs(self, hashes: Sequence[int], target: int) -> list[tuple[int, int | None]] | None:
        """(hash, cached window block or None: from a tier) for each window block a hit at `target` needs, in chain
        order; [] without a window group; None when the window pool has too few blocks free for the tier ones."""
        window = self.cache.window
        if window is None or not window.span:
            return []
        needs = [(h, window.pool.lookup(h)) for h in hashes[max(0, target - window.span) : target]]
        cached = [b for _, b in needs if b is not None]
        num_loaded = len(needs) - len(cached)
        return needs if num_loaded <= window.pool.num_free - window.pool.num_free_among(cached) else None

    def _allocate(self, request: Request, kv_len: int, target: int, cp: Located | None) -> TierLoad | None:
        cache, hashes = self.cache, request.block_hashes
        kv, state = cache.kv, cache.state
        prefix: list[int] = []
        if kv is not None:
            prefix = kv.find_prefix(hashes, min(kv_len, target))
            if target - len(prefix) > kv.pool.num_free - kv.pool.num_free_among(prefix):
                return None
        window_needs = self._window_needs(hashes, target)
        if window_needs is None:
            return None
        kv_keys = [TierKey(EntryKind.KV, h) for h in hashes[len(prefix) : target]] if kv is not None else []
        window_keys = [TierKey(EntryKind.WINDOW, h) for h, b in window_needs if b is None]
        entries = [(key, self.block_level(key.kind, key.block_hash)) for key in (*kv_keys, *window_keys)]
        entries += [cp] if cp is not None else []
        for key, level in entries:  # first: the allocations below demote, and a demotion may evict tier entries
            self.indexes[level].pin(key)  # type: ignore[index]
        checkpoint = None
        if cp is not None:
            assert state is not None
            slot = state.pool.allocate_checkpoint(cp[0].position, proven=True)
            if slot is None:
                for key, level in entries:
                    self.indexes[level].unpin(key)  # type: ignore[index]
                return None
            checkpoint = (cp[0], slot)
        blocks: list[int] = []
        if kv is not None:
            kv.pool.touch(prefix)
            blocks = kv.pool.allocate(len(kv_keys))
        held_window, window_blocks = self._take_window(window_needs)
        for key, level in entries:
            self.indexes[level].touch(key)  # type: ignore[index]
            self.indexes[level].counters.hits += 1  # type: ignore[index]
        levels = tuple(level for _, level in entries)
        load = TierLoad(request.request_id, tuple(zip(kv_keys, blocks)), checkpoint, levels,  # type: ignore[arg-type]
                        tuple(zip(window_keys, window_blocks)))  # fmt: skip
        self.promoting[request.request_id] = Promotion(load, (*prefix, *blocks), held_window, target)
        self.tried.add(request.request_id)
        return load

    def _take_window(self, needs: list[tuple[int, int | None]]) -> tuple[tuple[int, ...], list[int]]:
        """Hold the cached window blocks, then allocate one for each tier one: (all held in chain order, the new)."""
        if not needs:
            return (), []
        pool = self.cache.window.pool  # type: ignore[union-attr]
        pool.touch([b for _, b in needs if b is not None])  # first: the allocation must not evict them
        fresh = pool.allocate(sum(1 for _, b in needs if b is None))
        it = iter(fresh)
        return tuple(b if b is not None else next(it) for _, b in needs), fresh

    def complete(self, request: Request, report: TierLoadReport) -> None:
        """Register what the runner loaded (a leading run of KV blocks, the loaded window blocks, the checkpoint if
        reported as planned), then release the request's holds."""
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
        promoted = self._register_blocks(load, loaded)
        if load.checkpoint is not None:
            state = self.cache.state
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
        self._release(promotion)

    def _register_blocks(self, load: TierLoad, loaded: set[TierKey]) -> list[TierKey]:
        """Make the loaded KV (a leading run) and window blocks findable by hash; the keys registered."""
        kv, window = self.cache.kv, self.cache.window
        num_ok = 0
        while num_ok < len(load.kv) and load.kv[num_ok][0] in loaded:
            num_ok += 1
        if kv is not None and num_ok:
            kv.pool.cache_blocks([b for _, b in load.kv[:num_ok]], [k.block_hash for k, _ in load.kv[:num_ok]])
        ok_window = [(key, b) for key, b in load.window if key in loaded]
        if window is not None and ok_window:
            window.pool.cache_blocks([b for _, b in ok_window], [k.block_hash for k, _ in ok_window])
        return [key for key, _ in load.kv[:num_ok]] + [key for key, _ in ok_window]

    def _release(self, promotion: Promotion) -> None:
        """Drop the promotion's holds on read-pool blocks (destinations left unregistered become plain free)."""
        if self.cache.kv is not None:
            self.cache.kv.pool.free(promotion.held_blocks)
        if self.cache.window is not None and promotion.held_window:
            self.cache.window.pool.free(promotion.held_window)

    def cancel(self, request_id: str) -> None:
        """The request left while loading: release its holds (the runner discards the late data by request id)."""
        promotion = self.promoting.pop(request_id)
        load = promotion.load
        for key, _, level in load.entries():
            self.indexes[level].unpin(key)
        self._release(promotion)
        if load.checkpoint is not None:
            assert self.cache.state is not None
            self.cache.state.pool.free(load.checkpoint[1])
