"""KV block pool: exact ids, free-list order, eviction order, ref counts, reset."""

from __future__ import annotations

import random

import pytest

from recap.core.block_pool import BlockPool
from recap.core.free_queue import FreeBlockQueue, FrequencyQueue, KVBlock


def test_free_queue_links() -> None:
    q = FreeBlockQueue("q")
    blocks = [KVBlock(i) for i in range(4)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3] and len(q) == 3
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 0]
    with pytest.raises(AssertionError):
        q.append(blocks[1])  # already inside
    for _ in range(3):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_null_block_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.allocate(4) == [1, 2, 3, 4]
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check()


def test_freed_uncached_blocks_are_reused_first() -> None:
    pool = BlockPool(7)
    a = pool.allocate(3)  # 1 2 3
    pool.cache_block(a[0], 100)
    pool.cache_block(a[1], 101)
    pool.free(a)
    # 4, 5, 6 were never used; 3 is free without a hash; 1, 2 are cached.
    assert pool.allocate(4) == [4, 5, 6, 3]
    assert pool.num_cached_free == 2
    # Cached blocks go tail first: 2 (deeper in the chain) is evicted before 1.
    assert pool.allocate(1) == [2]
    assert pool.lookup(101) is None and pool.lookup(100) == 1
    assert pool.num_evicted == 1
    pool.check()


def test_lru_eviction_order_across_requests() -> None:
    pool = BlockPool(5)
    a = pool.allocate(2)  # 1 2
    b = pool.allocate(2)  # 3 4
    for block_id, h in zip(a + b, (10, 11, 20, 21)):
        pool.cache_block(block_id, h)
    pool.free(b)  # freed first: 4 then 3
    pool.free(a)  # then 2 then 1
    assert pool.allocate(4) == [4, 3, 2, 1]
    pool.check()


def test_touch_takes_block_out_of_free_list_and_counts_holders() -> None:
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.cache_block(a[0], 10)
    pool.cache_block(a[1], 11)
    pool.free(a)
    assert pool.num_free_among([1, 2]) == 2
    pool.touch([1])
    pool.touch([1])
    assert pool.blocks[1].ref_cnt == 2 and pool.num_free == 3
    assert pool.allocate(3) == [3, 4, 2]  # 1 is held, so never evicted
    pool.free([1])
    pool.free([1])
    assert pool.allocate(1) == [1]
    pool.check()


def test_cold_blocks_are_evicted_before_warm_ones() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    for block_id, h in zip(a + b, (10, 11, 20, 21, 22)):
        pool.cache_block(block_id, h)
    pool.free(a, num_warm=2)  # all warm
    pool.free(b, num_warm=1)  # 3 warm; 4 and 5 cold (past the deepest checkpoint)
    assert pool.allocate(5) == [5, 4, 2, 1, 3]
    pool.check()


def test_frequency_queue_goes_by_inflated_use_count_then_freeing_order() -> None:
    q = FrequencyQueue("reused")
    blocks = [KVBlock(i) for i in range(5)]
    for block, uses in zip(blocks, (3, 1, 2, 1, 3)):
        block.uses = uses
        q.append(block)
    q.remove(blocks[2])  # a hit takes it out from the middle
    assert len(q) == 4 and [b.block_id for b in q] == [1, 3, 0, 4]
    assert q.popleft() is blocks[1] and q.inflation == 1
    blocks[2].uses = 1
    q.append(blocks[2])  # freed now with one use: priority 1 + 1, ahead of the 3-use blocks
    assert [q.popleft().block_id for _ in range(4)] == [3, 2, 0, 4] and q.inflation == 3 and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_a_block_many_requests_used_outlives_a_less_used_one_freed_later() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10)
    pool.cache_block(b, 20)
    pool.free([a])
    pool.free([b])
    for _ in range(2):  # two more requests hit a: 3 uses
        pool.touch([a])
        pool.free([a])
    pool.touch([b])  # one more hit on b, freed last: 2 uses
    pool.free([b])
    pool.check()
    assert pool.allocate(1) == [b] and pool.lookup(20) is None and pool.lookup(10) == a  # LRU would take a
    pool.check()


def test_duplicate_of_a_held_block_stays_uncached() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    # a stays the cached copy (its holder may be reading it); the hash has now served two requests
    assert pool.lookup(7) == a and pool.blocks[b].block_hash is None and pool.blocks[a].reused
    pool.free([a, b])
    pool.check()


def test_recomputed_block_takes_over_a_free_cached_copy() -> None:
    # A request whose hit stopped at a checkpoint recomputes cached blocks past it. The new copy takes
    # over the hash, so recency and the reuse mark follow that request; the old copy would otherwise
    # age out from its first use while the request that just needed it went on.
    pool = BlockPool(5)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7)
    pool.free([a])
    (b,) = pool.allocate(1)
    assert b != a and pool.cache_block(b, 7)
    assert pool.lookup(7) == b and pool.blocks[a].block_hash is None and pool.blocks[b].reused
    pool.free([b])
    pool.check()
    assert pool.allocate(3) == [3, 4, a]  # never-used ids, then the old copy (plain): nothing evicted
    assert pool.lookup(7) == b and pool.num_evicted == 0
    assert pool.allocate(1) == [b] and pool.lookup(7) is None
    pool.check()


def test_double_free_is_caught() -> None:
    pool = BlockPool(3)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(AssertionError):
        pool.free(a)


def test_reset_forgets_hashes() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    for block_id, h in zip(a, (1, 2, 3)):
        pool.cache_block(block_id, h)
    pool.free(a[:2])
    pool.reset()
    assert pool.num_cached == 0 and pool.num_cached_free == 0 and pool.num_free == 2
    assert pool.lookup(3) is None
    pool.free(a[2:])
    pool.check()


def test_blocks_reused_by_a_second_request_outlive_one_off_blocks() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    for block_id, h in zip(a, (10, 11)):
        pool.cache_block(block_id, h)
    pool.free(a)
    pool.touch(a[:1])  # a second request hits block 10 (reused), not 11
    b = pool.allocate(3)
    for block_id, h in zip(b, (20, 21, 22)):
        pool.cache_block(block_id, h)
    pool.free(b)
    pool.free(a[:1])
    # Free lists: once = [2 (h11), 5, 4, 3] (LRU, tail first), reused = [1 (h10)].
    assert pool.allocate(4) == [2, 5, 4, 3]
    assert pool.lookup(10) == 1 and pool.lookup(11) is None
    pool.check()


def test_a_hash_computed_again_after_eviction_counts_as_reused() -> None:
    pool = BlockPool(3)  # two usable blocks
    a = pool.allocate(2)
    pool.cache_block(a[0], 10)
    pool.cache_block(a[1], 11)
    pool.free(a)
    evicted = []
    pool.on_evict = evicted.append
    b = pool.allocate(1)  # evicts h11 (the tail, freed first); it becomes a ghost
    assert evicted == [11] and pool.num_evicted == 1
    pool.cache_block(b[0], 11)  # recomputed while remembered: reused
    assert pool.blocks[b[0]].reused
    pool.free(b)
    c = pool.allocate(1)  # the one-off h10 goes before the recurring h11
    assert evicted == [11, 10] and c == a[:1]
    pool.cache_block(c[0], 12)
    assert not pool.blocks[c[0]].reused  # never seen before
    pool.check()


def test_recalled_prefix_runs_through_cached_and_evicted_hashes() -> None:
    pool = BlockPool(4)  # three usable blocks
    a = pool.allocate(3)
    for block, h in zip(a, (10, 11, 12)):
        pool.cache_block(block, h)
    pool.free(a)
    b = pool.allocate(2)  # evicts h12 then h11 (tail first): ghosts; h10 stays cached
    assert pool.lookup(10) == a[0] and pool.lookup(11) is None and pool.lookup(12) is None
    chain = [10, 11, 12, 13]
    assert pool.recalled_prefix(chain, 1, 4) == 3  # h13 was never computed
    assert pool.recalled_prefix(chain, 1, 2) == 2  # bounded by max_blocks
    assert pool.recalled_prefix([10, 99, 12], 1, 3) == 1  # a chain that left the old one at block 2
    assert pool.recalled_prefix([20, 11], 0, 2) == 0
    pool.cache_block(b[0], 13)
    assert pool.recalled_prefix(chain, 1, 4) == 4  # cached again past the ghosts
    pool.reset()
    assert pool.recalled_prefix(chain, 0, 4) == 0


def test_ghosts_are_bounded_and_forgotten_by_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    import recap.core.block_pool as block_pool

    monkeypatch.setattr(block_pool, "GHOST_BLOCKS_PER_BLOCK", 2)
    pool = BlockPool(3)  # 3 blocks: 6 ghosts at most, in generations of 3
    for h in range(100, 110):
        (b,) = pool.allocate(1)
        pool.cache_block(b, h)
        pool.free([b])
        pool.check()
    # Ten hashes cached in turn, 100..107 evicted: the full older generation (103-105) and the
    # filling newer one (106, 107) are remembered; 100-102 went with the generation before.
    remembered = {h for h in range(100, 110) if h in pool._ghosts or h in pool._old_ghosts}
    assert remembered == set(range(103, 108))
    (b,) = pool.allocate(1)
    pool.cache_block(b, 100)  # long forgotten: a one-off again
    assert not pool.blocks[b].reused
    pool.reset()
    assert not pool._ghosts and not pool._old_ghosts
    pool.check()


@pytest.mark.parametrize("seed", range(20))
def test_lookup_prefix_equals_its_reference(seed: int) -> None:
    """The hash map's C-level walk (lookup_prefix) against the block-by-block walk: random chains, some blocks
    evicted or never cached, bounds below, at and past the chain's length (and 0, negative)."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(8, 64))
    chains = [[rng.getrandbits(128) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    for chain in chains:  # cache what fits of each chain, then free it: later chains evict earlier blocks
        n = min(len(chain), pool.num_free)
        ids = pool.allocate(n)
        pool.cache_blocks(ids, chain[:n])
        pool.free(ids, rng.choice([None, 0, n // 2]))
    if rng.random() < 0.5:
        pool.touch(pool.lookup_prefix(chains[-1], 3))  # some held, some free
    for chain in [*chains, [rng.getrandbits(128)], []]:
        for bound in {-1, 0, 1, len(chain) // 2, len(chain), len(chain) + 5}:
            assert pool.lookup_prefix(chain, bound) == pool.lookup_prefix_ref(chain, bound)
    pool.check()
