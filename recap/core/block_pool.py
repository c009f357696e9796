"""The KV block pool: paged blocks of `block_size` tokens, shared by reference count, cached by hash.

Free blocks sit in one of four lists, handed out in this order:
  plain:  no hash (nothing to lose);
  cold:   cached, but past the deepest checkpoint of the request that freed them: for a hybrid model
          they cannot give a hit until some request learns a checkpoint there (DESIGN section 4);
  once:   cached, covered by a checkpoint (or the model has no state group), used by one request so far;
  reused: cached and covered, and its hash has served a second request: a hit on it, or it was
          computed again while the hash was still remembered as recently evicted (a ghost).
Inside plain, cold and once the least recently freed block goes first (LRU). In reused the lowest
GreedyDual-Frequency priority goes first: L + the requests the block's hash served, L the priority of
the last block evicted from that list (`FrequencyQueue`); against LRU it lifted the Mooncake trace's
80 GB sweep median from 16.62% to 16.82% (docs/replay.md). A request frees its blocks tail first, and
equal priorities go in freeing order, so a chain's deeper blocks are evicted before the blocks they
depend on.
A block computed again while a free copy is still cached (the request's hit stopped at a checkpoint
short of it) takes over the hash from that copy: recency and the reuse mark follow the request that
needed it. Left behind, the old copy aged out from its first use, and with it the branch point the
recomputing request had just checkpointed there.

Why two recency lists (2Q with ghost entries, as in ARC or the Linux page cache's refault tracking):
plain LRU lets a burst of one-off prompts flush the prefixes that keep coming back. On the Mooncake
trace a document is first shared a median of ~500 requests after it is first seen, far longer than
LRU keeps it, and then every ~150 requests; remembering evicted hashes lets the second use mark the
document as recurring, and recurring blocks then outlive the one-off traffic (docs/replay.md).
The ghosts also show a hybrid model where a request leaves a prefix earlier requests computed after KV
lost it (`recalled_prefix`): a branch point the KV hit alone would miss (+0.4 point at 80 GB).
"""

from __future__ import annotations

import functools
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice, takewhile

from recap.core.free_queue import FreeBlockQueue, FrequencyQueue, KVBlock

NULL_BLOCK_ID = 0
# Evicted hashes remembered, per pool block. Like TinyLFU's sample window (~10-16x the cache), long
# enough to see a document come back many pool turnovers later (on the Mooncake trace the first reuse
# comes ~500 requests after first use while 78 GB holds ~70 prompts; 2x caught too few, 16x and more
# all gave the same hit rate); bounded so a pool of millions of tiny blocks stays small.
GHOST_BLOCKS_PER_BLOCK = 16
MAX_GHOSTS = 1 << 22
_NOT_NONE = functools.partial(operator.is_not, None)
_BLOCK_ID = operator.attrgetter("block_id")


class BlockPool:
    """Owns every KV block id. Block 0 is the null block and is never handed out.

    Side effects: `allocate` may evict cached free blocks (their hashes stop being findable);
    `touch` takes cached blocks out of the free lists; `free` puts blocks back.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least one block besides the null block")
        self.num_blocks = num_blocks
        # Blocks are created on first use, in id order (a pool of millions would otherwise cost ~1 s up
        # front); ids past len(self.blocks) are free and plain, handed out before any reused block.
        self.blocks = [KVBlock(NULL_BLOCK_ID)]
        self._plain: deque[KVBlock] = deque()
        self._cold = FreeBlockQueue("cold")
        self._once = FreeBlockQueue("once")
        self._reused = FrequencyQueue("reused")
        self._cached: dict[int, KVBlock] = {}
        # Evicted hashes in two generations: when the newer holds half the bound, it becomes the older
        # and the older is forgotten, so between half the bound and the bound are remembered.
        self._ghosts: set[int] = set()
        self._old_ghosts: set[int] = set()
        self._ghost_generation = max(1, min(GHOST_BLOCKS_PER_BLOCK * num_blocks, MAX_GHOSTS) // 2)
        self.num_evicted = 0
        # Told each evicted hash: a hybrid's checkpoint keyed by it can no longer be reached.
        self.on_evict: Callable[[int], None] | None = None
        # Told (block id, hash) of each evicted block while its data is still in place: a lower tier saves it.
        self.on_spill: Callable[[int, int], None] | None = None

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (never used, plain, plus cached ones it would evict)."""
        return self.num_blocks - len(self.blocks) + len(self._plain) + self.num_cached_free

    @property
    def num_cached_free(self) -> int:
        return len(self._cold) + len(self._once) + len(self._reused)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    # -- lookup and sharing ------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        block = self._cached.get(block_hash)
        return None if block is None else block.block_id

    def lookup_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Ids of the longest run of cached blocks matching `block_hashes[:max_blocks]`: lookup_prefix_ref's
        answer, in one pass in C over the hash map (a 32k-token hit walks 2048 blocks: ~5x cheaper)."""
        found = takewhile(_NOT_NONE, map(self._cached.get, islice(block_hashes, max(max_blocks, 0))))
        return list(map(_BLOCK_ID, found))

    def lookup_prefix_ref(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """The reference of lookup_prefix: `lookup` block by block until a miss."""
        out: list[int] = []
        for i in range(min(max_blocks, len(block_hashes))):
            block_id = self.lookup(block_hashes[i])
            if block_id is None:
                break
            out.append(block_id)
        return out

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to `limit` findable hashes, the most recently cached last (what a router is told)."""
        hashes = list(self._cached)
        return hashes[-limit:] if len(hashes) > limit else hashes

    def recalled_prefix(self, block_hashes: Sequence[int], start: int, max_blocks: int) -> int:
        """Length of the prefix of `block_hashes[:max_blocks]` whose hashes are cached or remembered as evicted.

        `start`: leading blocks already known to be cached (the KV hit). Some earlier request computed
        every block of this prefix, even where the pool could not keep it.
        """
        cached, ghosts, old_ghosts = self._cached, self._ghosts, self._old_ghosts
        n, end = start, min(max_blocks, len(block_hashes))
        while n < end and ((h := block_hashes[n]) in cached or h in ghosts or h in old_ghosts):
            n += 1
        return n

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks sit in a free list (touching them lowers `num_free`)."""
        blocks = self.blocks
        return sum(1 for b in block_ids if blocks[b].ref_cnt == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block, taking free ones out of their free list (a hit)."""
        blocks = self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_cnt == 0:
                assert block.queue is not None, f"{block} is free but in no free list"
                block.queue.remove(block)
            block.ref_cnt += 1
            block.uses += 1

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Hand out `num` fresh blocks with one holder each, evicting cached free blocks if needed."""
        if num > self.num_free:
            raise MemoryError(f"need {num} KV blocks, only {self.num_free} free")
        out: list[int] = []
        blocks = self.blocks
        for _ in range(num):
            if len(blocks) < self.num_blocks:
                block = KVBlock(len(blocks))
                blocks.append(block)
            elif self._plain:
                block = self._plain.popleft()
            else:
                queue = self._cold if len(self._cold) else self._once if len(self._once) else self._reused
                block = queue.popleft()
                self._evict(block)
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        block_hash = block.block_hash
        del self._cached[block_hash]
        if self.on_spill is not None:  # before on_evict: a checkpoint stranded there may follow it down
            self.on_spill(block.block_id, block_hash)
        if self.on_evict is not None:
            self.on_evict(block_hash)
        self._ghosts.add(block_hash)
        if len(self._ghosts) >= self._ghost_generation:
            self._old_ghosts, self._ghosts = self._ghosts, set()
        block.block_hash = None
        block.uses = 0
        self.num_evicted += 1

    def free(self, block_ids: Sequence[int], num_warm: int | None = None) -> None:
        """Drop one holder from each block of a request's table (given in table order).

        Blocks whose last holder leaves go to a free list, tail first; cached blocks at table index
        >= `num_warm` go to the cold list (None: none is cold), the others to `once` or `reused`.
        """
        warm_limit = len(block_ids) if num_warm is None else num_warm
        blocks = self.blocks
        for index in range(len(block_ids) - 1, -1, -1):
            block = blocks[block_ids[index]]
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if block.block_hash is None:
                self._plain.append(block)
            elif index < warm_limit:
                (self._reused if block.uses > 1 else self._once).append(block)
            else:
                self._cold.append(block)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Make a full, computed block findable under `block_hash`.

        Returns False (and leaves the block uncached) when another block already holds that hash.
        """
        return self.cache_blocks([block_id], [block_hash]) == 1

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> int:
        """`cache_block` for each (block, hash) pair, in one call (a chunk's newly full blocks).

        Returns how many were cached.
        """
        blocks, cached, ghosts, old_ghosts = self.blocks, self._cached, self._ghosts, self._old_ghosts
        num_cached = 0
        for block_id, block_hash in zip(block_ids, block_hashes):
            block = blocks[block_id]
            assert block.ref_cnt > 0 and block.block_hash is None, f"cannot cache {block}"
            old = cached.get(block_hash)
            if old is not None:
                if old.ref_cnt:  # another request holds the cached copy: it stays cached, now shared twice
                    old.uses += 1
                    continue
                # A free copy computed before (this request's hit stopped short of it, at a checkpoint):
                # the new copy takes over the hash, so the block's recency and reuse mark follow the
                # request that just used it instead of ageing out behind it.
                assert old.queue is not None
                old.queue.remove(old)
                block.uses = old.uses + 1
                old.block_hash = None
                old.uses = 0
                self._plain.append(old)
            elif block_hash in ghosts or block_hash in old_ghosts:  # computed again after eviction
                ghosts.discard(block_hash)
                old_ghosts.discard(block_hash)
                block.uses = 2
            else:
                block.uses = 1
            block.block_hash = block_hash
            cached[block_hash] = block
            num_cached += 1
        return num_cached

    def reset(self) -> None:
        """Forget every hash; free cached blocks become plain free blocks."""
        for block in self._cached.values():
            block.block_hash = None
            block.uses = 0
            if block.queue is not None:
                block.queue.remove(block)
                self._plain.append(block)
        self._cached.clear()
        self._ghosts.clear()
        self._old_ghosts.clear()

    # -- integrity -------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the lists, hashes and counts agree. O(pool): for tests, not the hot path."""
        free_ids: set[int] = set()
        for block in self._plain:
            assert block.queue is None and block.ref_cnt == 0 and block.block_hash is None, block
            assert not block.reused, f"{block} has no hash but is marked reused"
            free_ids.add(block.block_id)
        assert len(self._ghosts) < self._ghost_generation and len(self._old_ghosts) <= self._ghost_generation
        for queue in (self._cold, self._once, self._reused):
            count = 0
            for block in queue:
                holder = block.queue if block.queue is None or block.queue.owner is None else block.queue.owner
                assert holder is queue and block.ref_cnt == 0 and block.block_hash is not None, block
                assert queue is not self._reused or block.reused, f"{block} in the reused list unmarked"
                free_ids.add(block.block_id)
                count += 1
            assert count == len(queue), f"free list {queue.name} size {len(queue)} != {count} linked"
        assert NULL_BLOCK_ID not in free_ids, "null block in a free list"
        assert len(free_ids) + self.num_blocks - len(self.blocks) == self.num_free, "a block sits in two free lists"
        assert [b.block_id for b in self.blocks] == list(range(len(self.blocks))), "blocks created out of order"
        for block in self.blocks[1:]:
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), f"{block}: free iff no holder"
        null = self.blocks[NULL_BLOCK_ID]
        assert null.ref_cnt == 0 and null.block_hash is None, "null block handed out"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry disagrees with {block}"
        cached_ids = {b.block_id for b in self._cached.values()}
        for block in self.blocks:
            assert (block.block_hash is not None) == (block.block_id in cached_ids), f"{block} not mapped"
