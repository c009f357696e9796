"""The coordinator over cache groups: the longest common hit, admission, growth and checkpoints.

A hit for a hybrid model needs every group (DESIGN section 1): the largest n = k * block_size with
n < num_tokens such that the first k KV blocks are cached, a checkpoint exists after k blocks, and the
window group (sliding-window layers) has the blocks of the window before n cached.
Attention-only models hit on the KV prefix alone; SSM-only models on the checkpoint alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from recap.config import CacheConfig, CacheLayout
from recap.core.block_pool import BlockPool
from recap.core.hashing import BlockHasher
from recap.core.kv_manager import KVManager, cdiv
from recap.core.output import PAD_SLOT_ID, CheckpointWrite
from recap.core.policy import CheckpointPolicy
from recap.core.request import Request
from recap.core.seen_index import SeenIndex
from recap.core.state_manager import StateManager
from recap.core.state_pool import StatePool
from recap.core.window_manager import WindowManager


@dataclass(frozen=True)
class CacheHit:
    """What a request can skip: `num_tokens` tokens, served by these KV blocks and this checkpoint."""

    num_tokens: int
    kv_block_ids: tuple[int, ...] = ()
    checkpoint_slot: int = PAD_SLOT_ID
    kv_hit_tokens: int = 0  # the KV prefix alone (>= num_tokens); equals num_tokens without a state group
    # The prefix earlier requests computed as far as the cache remembers (>= kv_hit_tokens): the KV hit
    # continued through evicted blocks whose hashes the pool still remembers.
    seen_tokens: int = 0
    # The window group's table for the hit (null ids for blocks out of the window); () without the group.
    window_block_ids: tuple[int, ...] = ()

    @property
    def checkpoint_miss_tokens(self) -> int:
        """KV matched past the best checkpoint: tokens recomputed only for want of a checkpoint."""
        return self.kv_hit_tokens - self.num_tokens


NO_HIT = CacheHit(0)
SEEN_BLOCKS_PER_SLOT = 256  # SSM-only models: hashes remembered for branch learning, per state slot


class CacheManager:
    """One manager per cache group plus the checkpoint policy, behind one request-level interface.

    Side effects: see each method; all pool changes go through the group managers.
    """

    def __init__(self, cache_config: CacheConfig, layout: CacheLayout) -> None:
        if layout.block_size != cache_config.block_size:
            raise ValueError(f"layout block_size {layout.block_size} != cache block_size {cache_config.block_size}")
        self.block_size = bs = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.layout = layout
        self.kv: KVManager | None = None
        self.state: StateManager | None = None
        if layout.has_kv:
            self.kv = KVManager(BlockPool(layout.num_kv_blocks), bs, self.enable_caching)
        if layout.has_state:
            pool = StatePool(layout.num_state_slots, bs, layout.state_bytes_per_slot, layout.flops_per_token)
            state_caching = self.enable_caching and cache_config.checkpoint_policy != "none"
            self.state = StateManager(pool, bs, state_caching)
        self.window: WindowManager | None = None
        if layout.has_window:
            pool = BlockPool(layout.num_window_blocks)
            self.window = WindowManager(pool, bs, self.enable_caching, layout.sliding_window)
        if self.kv is not None and self.state is not None:
            self.kv.pool.on_evict = self.state.pool.strand
        if self.window is not None and self.state is not None and self.window.span:
            # A checkpoint after block k needs window block k - 1: its eviction strands the checkpoint too.
            self.window.pool.on_evict = self.state.pool.strand
        # The tail learner reads the extent at the end of a KV hit (or seen prefix): only hashes the KV
        # pool (or the seen index) holds are read again, so it sweeps the others once it holds twice that.
        seen_capacity = SEEN_BLOCKS_PER_SLOT * layout.num_state_slots
        extent_capacity = 2 * max(1, layout.num_kv_blocks if layout.has_kv else seen_capacity)
        self.policy = CheckpointPolicy(cache_config, layout.has_state, extent_capacity, self.indexes)
        if self.state is not None and self.policy.learns_yield:  # only recap learns from outcomes
            self.state.pool.on_outcome = self.policy.record_outcome
        self.lower_kv: Callable[[int], bool] | None = None  # a lower tier's KV index (core/tier_scheduling.py)
        self.hasher = BlockHasher(bs)
        # Without a KV group, recently computed hashes stand in for the KV prefix (branch learning).
        self.seen: SeenIndex | None = None
        self._seen_upto: dict[str, int] = {}
        if self.kv is None and self.policy.enabled:
            self.seen = SeenIndex(seen_capacity)

    def indexes(self, block_hash: int) -> bool:
        """Whether a later request's KV hit (or seen prefix) can still end at this block hash (in the KV pool or
        a lower tier's KV)."""
        if self.kv is not None:
            return self.kv.pool.lookup(block_hash) is not None or (self.lower_kv is not None and
                                                                    self.lower_kv(block_hash))  # fmt: skip
        return self.seen is not None and block_hash in self.seen

    # -- hashing ----------------------------------------------------------------------------------
    def update_hashes(self, request: Request) -> None:
        """Hash any newly completed token block of the request (no-op with caching off)."""
        if self.enable_caching and request.num_tokens // self.block_size > len(request.block_hashes):
            self.hasher.update(request)

    # -- hits and admission -----------------------------------------------------------------------
    def find_hit(self, request: Request) -> CacheHit:
        """The longest common hit over all cache groups; never the last token."""
        if not self.enable_caching or request.prompt_logprobs:
            return NO_HIT
        bs, hashes = self.block_size, request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        kv_blocks = self.kv.find_prefix(hashes, max_blocks) if self.kv else None
        kv_len = len(kv_blocks) if kv_blocks is not None else max_blocks
        if self.state is None and self.window is None:
            return CacheHit(kv_len * bs, tuple(kv_blocks or ()), PAD_SLOT_ID, kv_len * bs, kv_len * bs)
        k, slot, window_ids = self._common_hit(hashes, kv_len)
        if kv_blocks is not None:
            seen = self.kv.pool.recalled_prefix(hashes, kv_len, max_blocks) if self.kv and self.state else kv_len
            return CacheHit(k * bs, tuple(kv_blocks[:k]), slot, kv_len * bs, seen * bs, window_ids)
        if self.state is None:  # sliding-window attention alone
            return CacheHit(k * bs, (), PAD_SLOT_ID, k * bs, k * bs, window_ids)
        # No KV group: the seen index stands in for the KV prefix.
        seen = max(self.seen.prefix_len(hashes, max_blocks) if self.seen is not None else 0, k)
        return CacheHit(k * bs, (), slot, seen * bs, seen * bs, window_ids)

    def _common_hit(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int, tuple[int, ...]]:
        """(k, checkpoint slot, window table): the deepest k <= max_blocks both the state and window groups serve.

        Each group's answer for a bound is the deepest k it serves at or below the bound; a window hit
        is not monotone in k, so the groups take turns lowering the bound until both agree (vLLM's
        hybrid coordinator does the same fixed point).
        """
        k, slot = max_blocks, PAD_SLOT_ID
        while True:
            if self.state is not None:
                k, slot = self.state.find_checkpoint(hashes, k)
            if self.window is None:
                return k, slot, ()
            k_window, window_ids = self.window.find_hit(hashes, k)
            if k_window == k:
                return k, slot, tuple(window_ids)
            k = k_window

    def can_admit(self, hit: CacheHit, num_new_tokens: int) -> bool:
        if self.kv and not self.kv.can_admit(hit.kv_block_ids, hit.num_tokens + num_new_tokens):
            return False
        if self.window and not self.window.can_admit(hit.window_block_ids, hit.num_tokens + num_new_tokens):
            return False
        return not (self.state and not self.state.can_admit(hit.checkpoint_slot))

    def admit(self, request: Request, hit: CacheHit, num_new_tokens: int) -> tuple[int, int] | None:
        """Share the hit's KV blocks, pin its checkpoint, take a running slot and new blocks.

        Returns the (checkpoint slot, running slot) copy the runner performs before the step.
        """
        copy = None
        if self.state:
            copy = self.state.admit(request.request_id, hit.checkpoint_slot)
        if self.kv:
            self.kv.admit(request.request_id, hit.kv_block_ids, hit.num_tokens + num_new_tokens)
        if self.window:
            self.window.admit(request.request_id, hit.window_block_ids, hit.num_tokens + num_new_tokens)
        self.policy.admit(request, hit.num_tokens, hit.kv_hit_tokens, hit.seen_tokens)
        return copy

    def try_grow(self, request_id: str, num_tokens: int, num_computed: int = 0) -> bool:
        """Extend the request's tables to cover `num_tokens` tokens if the pools allow; False if not.

        The window group first frees the blocks the request, at `num_computed` tokens, no longer reads.
        """
        if self.window is not None:
            return self._try_grow_groups(request_id, num_tokens, num_computed)
        kv = self.kv
        if kv is None:
            return True
        table = kv.tables[request_id]
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return True
        if num_new > kv.pool.num_free:
            return False
        table += kv.pool.allocate(num_new)
        return True

    def _try_grow_groups(self, request_id: str, num_tokens: int, num_computed: int) -> bool:
        """try_grow with a window group: all tables grow or none does."""
        assert self.window is not None
        self.window.free_out_of_window(request_id, num_computed)
        groups = [g for g in (self.kv, self.window) if g is not None]
        need = [cdiv(num_tokens, self.block_size) - len(g.tables[request_id]) for g in groups]
        if any(n > g.pool.num_free for n, g in zip(need, groups)):
            return False
        for n, g in zip(need, groups):
            if n > 0:
                g.tables[request_id] += g.pool.allocate(n)
        return True

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens of one request fit the KV pools at all (a chunk may need every block)."""
        num_blocks = cdiv(num_tokens, self.block_size)
        if self.window is not None and num_blocks > self.window.pool.num_usable:
            return False
        return self.kv is None or num_blocks <= self.kv.pool.num_usable

    # -- per-step plans and commits ----------------------------------------------------------------
    def plan_checkpoints(self, request: Request, start: int, end: int) -> list[CheckpointWrite]:
        """Checkpoint writes for a chunk (start, end]; a boundary with no slot to be had is skipped."""
        if self.state is None or not self.policy.enabled:
            return []
        if self.policy.every_block:  # policy `all`: the boundaries as a range, no Position each
            boundaries = self.policy.boundaries(start, end)
            return self.state.plan_every_block(request.request_id, request.block_hashes, boundaries)
        positions = self.policy.positions(request, start, end)
        return self.state.plan(request.request_id, request.block_hashes, positions) if positions else []

    def commit(self, request: Request, written: Sequence[CheckpointWrite], planned: bool = True) -> int:
        """After a step: register written checkpoints and newly full KV blocks.

        `planned`: whether the step planned checkpoints for this request (False skips the state group).
        Returns the number of checkpoints registered.
        """
        registered = 0
        state = self.state
        if state is not None and (planned or written):
            if request.request_id in state.pending:
                # A step scheduled ahead may have planned past this one (async scheduling): those stay pending.
                registered = state.commit(request, written, request.num_computed_tokens)
            else:
                state.pool.num_refused += len(written)  # writes nobody planned: never registered
        if self.window is not None:
            self.window.cache_full_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)
        if self.kv is not None:
            self.kv.cache_full_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)
        elif self.seen is not None:
            self._note_seen(request)
        return registered

    def _note_seen(self, request: Request) -> None:
        assert self.seen is not None
        rid = request.request_id
        start = self._seen_upto.get(rid, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            self.seen.add(request.block_hashes[start:end])
            self._seen_upto[rid] = end

    def unpin(self, slots: Sequence[int]) -> None:
        if self.state:
            for slot in slots:
                self.state.pool.unpin(slot)

    # -- views ------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.tables[request_id] if self.kv else []

    def window_block_ids(self, request_id: str) -> list[int]:
        return self.window.tables[request_id] if self.window else []

    def state_slot(self, request_id: str) -> int:
        return self.state.running[request_id] if self.state else PAD_SLOT_ID

    # -- release ----------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Return everything the request holds; its registered blocks and checkpoints stay findable."""
        rid = request.request_id
        for group in (self.kv, self.window):
            if group is None:
                continue
            num_warm = None
            if self.state is not None:
                # KV blocks past the deepest checkpoint of this chain cannot hit yet: evict them first.
                num_warm, _ = self.state.find_checkpoint(request.block_hashes, group.num_hashed(rid))
            group.free(rid, num_warm)
        if self.state:
            self.state.free(rid)
        self._seen_upto.pop(rid, None)
        self.policy.forget(rid)

    def reset(self) -> None:
        """Forget every cached block and checkpoint (call between steps: nothing pinned)."""
        if self.kv:
            self.kv.pool.reset()
        if self.window:
            self.window.pool.reset()
        if self.state:
            self.state.pool.reset()
            self.state.forget_provisional()
        if self.seen is not None:
            self.seen.clear()
