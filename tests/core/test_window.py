"""The sliding-window cache group: blocks leave the window (and the request) while it runs, and a hit needs
only the window's blocks before it, with exact block ids. Window 6, block size 4: a block-aligned hit at n
needs the 2 blocks before n (positions n - 5 .. n - 1)."""

from __future__ import annotations

import pytest

from recap.config import CacheConfig
from recap.core.block_pool import NULL_BLOCK_ID, BlockPool
from recap.core.cache_manager import CacheManager
from recap.core.output import PAD_SLOT_ID
from recap.core.request import Request
from recap.core.window_manager import WindowManager
from tests.core.helpers import Harness, make_layout, make_scheduler, req
from tests.core.test_cache_manager import PROMPT, run_prefill

BS = 4


def manager(kind: str, policy: str = "recap", **kw: object) -> CacheManager:
    return CacheManager(CacheConfig(block_size=BS, checkpoint_policy=policy), make_layout(kind, BS, **kw))  # type: ignore[arg-type]


def window_pool(cached: dict[int, int]) -> tuple[WindowManager, list[int]]:
    """A window manager whose pool holds blocks 1..6; block i + 1 cached under hash 100 + i if i in `cached`."""
    pool = BlockPool(8)
    ids = pool.allocate(6)
    pool.cache_blocks([ids[i] for i in cached], [100 + i for i in cached])
    return WindowManager(pool, BS, True, 6), [100 + i for i in range(6)]


@pytest.mark.parametrize(
    ("cached", "max_blocks", "k", "table"),
    [
        ({0, 1, 2, 3, 4, 5}, 6, 6, [0, 0, 0, 0, 5, 6]),  # only the last two blocks are needed
        ({4, 5}, 6, 6, [0, 0, 0, 0, 5, 6]),  # nothing before the window is
        ({0, 1, 2, 3, 4, 5}, 4, 4, [0, 0, 3, 4]),  # the bound
        ({0, 2, 3, 5}, 6, 4, [0, 0, 3, 4]),  # block 4 is missing: the deepest window is before it
        ({0, 3, 5}, 6, 1, [1]),  # no two cached in a row: the run from block 0, however short
        ({1, 2}, 6, 3, [0, 2, 3]),
        ({1, 3, 5}, 6, 0, []),
    ],
)
def test_find_hit_from_the_right(cached: set[int], max_blocks: int, k: int, table: list[int]) -> None:
    wm, hashes = window_pool(dict.fromkeys(cached, 0))
    assert wm.span == 2
    assert wm.find_hit(hashes, max_blocks) == (k, table)


def test_window_of_one_token_needs_no_block() -> None:
    wm = WindowManager(BlockPool(4), BS, True, 1)
    assert wm.span == 0 and wm.find_hit([7, 8, 9], 2) == (2, [NULL_BLOCK_ID] * 2)


def test_blocks_leave_the_window_while_running_and_stay_findable() -> None:
    cm = manager("window")
    a = Request("a", PROMPT, 4)  # 22 tokens
    cm.update_hashes(a)
    hit = cm.find_hit(a)
    assert hit.num_tokens == 0 and cm.can_admit(hit, 22)
    cm.admit(a, hit, 22)
    assert cm.window_block_ids("a") == [1, 2, 3, 4, 5, 6]
    a.num_computed_tokens = 22
    cm.commit(a, [])
    assert cm.window is not None and cm.window.pool.num_in_use == 6
    # Next token at position 22 sees 17..22: blocks 0..3 (positions 0..15) are out of its window.
    assert cm.try_grow("a", 23, 22)
    assert cm.window_block_ids("a") == [0, 0, 0, 0, 5, 6] and cm.window.pool.num_in_use == 2
    # Another request shares the prefix while a still runs: it needs only blocks 3 and 4 (positions 12..19).
    b = Request("b", PROMPT[:22] + [7] * 6, 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == 20 and hit.window_block_ids == (0, 0, 0, 4, 5)
    cm.admit(b, hit, 8)
    assert cm.window_block_ids("b") == [0, 0, 0, 4, 5, 7, 8]
    assert cm.window.pool.blocks[4].ref_cnt == 1 and cm.window.pool.blocks[5].ref_cnt == 2
    for r in (a, b):
        cm.free(r)
    assert cm.window.pool.num_in_use == 0


def test_hit_is_the_fixed_point_of_checkpoints_and_windows() -> None:
    """Checkpoint at 20 but the window before it lost block 3: the hit falls to the checkpoint at 12."""
    cm = manager("hybrid+window", policy="all", num_window_blocks=7)
    run_prefill(cm, Request("a", PROMPT, 1))  # checkpoints at 4, 8, ..., 20; window blocks 1..6
    assert cm.window is not None and cm.state is not None
    pool = cm.window.pool
    pool.touch([5])  # keep block 5 (positions 16..19) out of the free lists
    assert pool.allocate(2) == [6, 4]  # the partial block, then the LRU cached one: block 4 (positions 12..15)
    pool.free([5])
    assert cm.state.pool.num_stranded == 1  # the checkpoint at 16 ends on the evicted block
    b = Request("b", PROMPT[:22] + [7] * 6, 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == 12 and hit.kv_block_ids == (1, 2, 3) and hit.window_block_ids == (0, 2, 3)
    assert hit.kv_hit_tokens == 20 and hit.checkpoint_slot != PAD_SLOT_ID
    assert cm.state.pool.slot_position[hit.checkpoint_slot] == 12


def test_blocks_before_the_window_of_a_hit_are_not_needed() -> None:
    """Evicting the window blocks of the first 8 positions leaves the hit at 20; no window at all, no hit."""
    cm = manager("hybrid+window", policy="all", num_window_blocks=7)
    run_prefill(cm, Request("a", PROMPT, 1))
    assert cm.window is not None
    pool = cm.window.pool
    pool.touch([3, 4, 5])
    assert pool.allocate(3) == [6, 2, 1]  # evicts the window blocks of positions 0..7
    pool.free([3, 4, 5])
    b = Request("b", PROMPT[:22] + [7] * 6, 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == 20 and hit.window_block_ids == (0, 0, 0, 4, 5) and hit.kv_block_ids == (1, 2, 3, 4, 5)
    pool.reset()
    c = Request("c", PROMPT[:22] + [7] * 6, 1)
    cm.update_hashes(c)
    assert cm.find_hit(c).num_tokens == 0  # KV and checkpoints alone are not a hit


def test_scheduler_frees_blocks_out_of_the_window_each_step() -> None:
    """A long decode holds at most the window's blocks plus the one being written."""
    sched = make_scheduler("window", "none", BS, sliding_window=6, num_window_blocks=12)
    h = Harness(sched)
    r = h.add(req("r", list(range(10)), max_tokens=30))
    assert sched.cache.window is not None
    peak = 0
    while sched.has_unfinished_requests():
        h.step()
        if sched.get_request("r") is not None:
            peak = max(peak, sched.cache.window.pool.num_in_use)
    assert r.is_finished and len(r.output_token_ids) == 30  # 40 tokens through a 4-block window pool
    assert peak <= 3

