"""An intrusive doubly linked list of KV blocks: O(1) append, pop-oldest and removal from the middle.

A `collections.deque` cannot remove from the middle in O(1), and a prefix hit must pull a cached block
out of the free list wherever it sits. The links live on the blocks themselves, so the list allocates
nothing per operation.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class KVBlock:
    """One paged KV block: id, holders count, hash when full and cached, free-list links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "uses", "prev", "next", "queue")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # Requests its hash has served while cached (0 when uncached): its weight in FrequencyQueue.
        self.uses = 0
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None
        self.queue: FreeBlockQueue | None = None  # the free list holding this block, if any

    @property
    def reused(self) -> bool:
        """Its hash served a second request (a hit, or computed again soon after eviction)."""
        return self.uses > 1

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in least-recently-freed-first order.

    Side effects: rewrites the `prev`/`next`/`queue` fields of the blocks it holds.
    """

    def __init__(self, name: str, owner: FrequencyQueue | None = None, priority: int = 0) -> None:
        self.name = name
        self.owner = owner  # the FrequencyQueue this list is one priority bucket of, if any
        self.priority = priority  # that bucket's priority
        self._head = KVBlock(-1)  # sentinels: no special cases at the ends
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, block: KVBlock) -> None:
        """Insert `block` as the most recently freed."""
        assert block.queue is None, f"{block} is already in free list {block.queue.name}"
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        block.queue = self
        self._size += 1

    def popleft(self) -> KVBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError(f"free list {self.name} is empty")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.queue is self, f"{block} is not in free list {self.name}"
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        block.queue = None
        self._size -= 1
        if self.owner is not None:
            self.owner.removed(self)

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next


class FrequencyQueue:
    """Free blocks by GreedyDual-Frequency: the lowest `inflation + uses` goes first.

    `inflation` is the priority of the last block handed out, so a block freed now outranks one of the
    same use count freed long ago (recency), while a block many requests used outlives one-off blocks
    freed after it (frequency). Equal priorities go in freeing order: a request frees its table tail
    first, so a chain's deeper blocks still go before the blocks they depend on.
    Priorities are small integers above `inflation`, so each has its own FreeBlockQueue (a bucket): a
    block's `queue` is its bucket, and append, removal and popleft stay O(1) apart from a heap of the
    few live priorities.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.inflation = 0
        self._buckets: dict[int, FreeBlockQueue] = {}
        self._keys: list[int] = []  # priorities with a bucket (a heap; stale keys skipped)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, block: KVBlock) -> None:
        """Insert `block` at priority inflation + uses, after the blocks already there."""
        priority = self.inflation + block.uses
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = FreeBlockQueue(self.name, self, priority)
            heapq.heappush(self._keys, priority)
        bucket.append(block)
        self._size += 1

    def popleft(self) -> KVBlock:
        """Remove and return the block of lowest priority (the oldest freed among equals)."""
        keys, buckets = self._keys, self._buckets
        while keys:
            bucket = buckets.get(keys[0])
            if bucket is None:  # emptied since its key was pushed
                heapq.heappop(keys)
                continue
            self.inflation = keys[0]
            return bucket.popleft()  # `removed` updates the count
        raise IndexError(f"free list {self.name} is empty")

    def remove(self, block: KVBlock) -> None:
        """Take `block` out wherever it sits (`block.queue.remove` does the same)."""
        bucket = block.queue
        assert bucket is not None and bucket.owner is self, f"{block} is not in free list {self.name}"
        bucket.remove(block)

    def removed(self, bucket: FreeBlockQueue) -> None:
        """A bucket lost a block (handed out or hit)."""
        self._size -= 1
        if not len(bucket):
            del self._buckets[bucket.priority]

    def __iter__(self) -> Iterator[KVBlock]:
        for priority in sorted(self._buckets):
            yield from self._buckets[priority]
