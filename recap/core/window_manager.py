"""The window group's manager: block tables of the sliding-window attention layers over their own BlockPool.

Words: a window of `w` tokens means a query at position p attends the keys at positions p - w + 1 .. p.
So to compute position p a request needs only the blocks holding positions >= p - w + 1; every block that
ends at or before p - w + 1 is *out of the window* and is freed while the request runs (vLLM's
SlidingWindowManager is the anchor). Its table entry becomes NULL_BLOCK_ID; the block keeps its hash, so
another request can still hit on it until the pool evicts it. Null entries are always a leading run.

A hit at n = k * block_size needs only the `span` = cdiv(w - 1, block_size) blocks before it (they hold
positions n - w + 1 .. n - 1); the earlier table entries of the hit are null. `find_hit` looks for the
deepest such k from the right; a run of cached blocks that starts at block 0 is a hit however short.
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.core.block_pool import NULL_BLOCK_ID, BlockPool
from recap.core.kv_manager import KVManager, cdiv


class WindowManager(KVManager):
    """Side effects as KVManager's, plus `free_out_of_window` returning blocks while a request runs."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool, window: int) -> None:
        if window <= 0:
            raise ValueError(f"a sliding window needs >= 1 token, got {window}")
        super().__init__(pool, block_size, enable_caching)
        self.window = window
        self.span = cdiv(window - 1, block_size)  # blocks a block-aligned hit needs before it
        self._num_null: dict[str, int] = {}  # leading null entries per table

    def num_out_of_window(self, num_computed: int) -> int:
        """Leading blocks a request that has computed `num_computed` tokens never reads again."""
        return max(0, (num_computed - self.window + 1) // self.block_size)

    def find_hit(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, list[int]]:
        """(k, table): the deepest k <= max_blocks whose window before k * block_size is cached.

        `table` has k entries: null for the blocks out of the window, the cached ids for the rest.
        """
        lookup, span = self.pool.lookup, self.span
        end = min(max_blocks, len(block_hashes))
        if span == 0:  # a query sees only itself: nothing before a hit is needed
            return end, [NULL_BLOCK_ID] * end
        run: list[int] = []  # cached ids of the current run, right to left
        for i in range(end - 1, -1, -1):
            block_id = lookup(block_hashes[i])
            if block_id is None:
                run = []
                continue
            run.append(block_id)
            if len(run) == span:
                return i + span, [NULL_BLOCK_ID] * i + run[::-1]
        return len(run), run[::-1]  # the run that starts at block 0 (empty if block 0 is not cached)

    def can_admit(self, hit_blocks: Sequence[int], num_tokens: int) -> bool:
        live = [b for b in hit_blocks if b != NULL_BLOCK_ID]
        num_new = cdiv(num_tokens, self.block_size) - len(hit_blocks)
        return num_new <= self.pool.num_free - self.pool.num_free_among(live)

    def admit(self, request_id: str, hit_blocks: Sequence[int], num_tokens: int) -> None:
        num_null = 0
        while num_null < len(hit_blocks) and hit_blocks[num_null] == NULL_BLOCK_ID:
            num_null += 1
        assert NULL_BLOCK_ID not in hit_blocks[num_null:], "a window hit has a null block after a live one"
        assert request_id not in self.tables, f"{request_id} already holds window blocks"
        self.pool.touch(hit_blocks[num_null:])
        table = list(hit_blocks)
        table += self.pool.allocate(cdiv(num_tokens, self.block_size) - len(table))
        self.tables[request_id] = table
        self._num_hashed[request_id] = len(hit_blocks)
        self._num_null[request_id] = num_null

    def free_out_of_window(self, request_id: str, num_computed: int) -> int:
        """Free the blocks before the window of the next token; returns how many were freed.

        They were hashed when they became full (caching on), so they stay findable until evicted.
        """
        table = self.tables[request_id]
        start, end = self._num_null[request_id], min(self.num_out_of_window(num_computed), len(table))
        if end <= start:
            return 0
        assert not self.enable_caching or end <= self._num_hashed[request_id], "freeing a block never hashed"
        self.pool.free(table[start:end])
        table[start:end] = [NULL_BLOCK_ID] * (end - start)
        self._num_null[request_id] = end
        return end - start

    def num_null(self, request_id: str) -> int:
        return self._num_null.get(request_id, 0)

    def free(self, request_id: str, num_warm: int | None = None) -> None:
        num_null = self._num_null.pop(request_id, 0)
        table = self.tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table and len(table) > num_null:
            warm = None if num_warm is None else max(0, num_warm - num_null)
            self.pool.free(table[num_null:], warm)
