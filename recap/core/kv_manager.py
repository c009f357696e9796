"""The KV cache group's manager: one block table per request over the shared BlockPool."""

from __future__ import annotations

from collections.abc import Sequence

from recap.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """Block tables of the attention layers, per request id.

    Side effects: `admit`/`grow` take blocks from the pool (may evict cached free blocks); `free`
    returns them; `cache_full_blocks` makes a request's computed full blocks findable by hash.
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the hash map (cached or duplicate).
        self._num_hashed: dict[str, int] = {}

    def find_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Ids of the longest run of cached blocks matching `block_hashes[:max_blocks]`."""
        return self.pool.lookup_prefix(block_hashes, max_blocks)

    def can_admit(self, hit_blocks: Sequence[int], num_tokens: int) -> bool:
        """Whether a table of `num_tokens` tokens starting with `hit_blocks` fits now."""
        num_new = cdiv(num_tokens, self.block_size) - len(hit_blocks)
        return num_new <= self.pool.num_free - self.pool.num_free_among(hit_blocks)

    def admit(self, request_id: str, hit_blocks: Sequence[int], num_tokens: int) -> None:
        """Share `hit_blocks` (touching them first so they cannot be evicted) and allocate the rest."""
        assert request_id not in self.tables, f"{request_id} already holds KV blocks"
        self.pool.touch(hit_blocks)
        table = list(hit_blocks)
        table += self.pool.allocate(cdiv(num_tokens, self.block_size) - len(table))
        self.tables[request_id] = table
        self._num_hashed[request_id] = len(hit_blocks)

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[int], num_computed: int) -> None:
        """Register every full block whose tokens are all computed."""
        end = num_computed // self.block_size
        start = self._num_hashed[request_id]
        if end <= start or not self.enable_caching:
            return
        end = min(end, len(block_hashes))
        self.pool.cache_blocks(self.tables[request_id][start:end], block_hashes[start:end])
        self._num_hashed[request_id] = end

    def num_hashed(self, request_id: str) -> int:
        return self._num_hashed.get(request_id, 0)

    def free(self, request_id: str, num_warm: int | None = None) -> None:
        table = self.tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table:
            self.pool.free(table, num_warm)
