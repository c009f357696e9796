"""Block hashes recently computed, for models without a KV group.

A hybrid model learns branch points from its KV hit running past its best checkpoint. An SSM-only
model has no KV blocks to match, so it keeps this bounded LRU set of chain hashes that some request
computed: its longest matching prefix plays the KV hit's part (it is never a hit by itself).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SeenIndex:
    """A bounded LRU set of block hashes. Side effects: `add` may forget the least recent hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def add(self, block_hashes: Sequence[int]) -> None:
        hashes = self._hashes
        for h in block_hashes:
            hashes[h] = None
            hashes.move_to_end(h)
        while len(hashes) > self.capacity:
            hashes.popitem(last=False)

    def prefix_len(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Length of the longest prefix of `block_hashes[:max_blocks]` seen; refreshes what it matched."""
        hashes = self._hashes
        n = 0
        for i in range(min(max_blocks, len(block_hashes))):
            if block_hashes[i] not in hashes:
                break
            hashes.move_to_end(block_hashes[i])
            n += 1
        return n

    def clear(self) -> None:
        self._hashes.clear()
