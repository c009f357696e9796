"""The sliding-window group's part of a disaggregated transfer (recap.core.transfer): which window blocks the
prefill side holds and offers, which the decode side asks for, and where they land. Integer bookkeeping.

Words (core/window_manager.py plus): for a prompt of P tokens the decode side's first step computes position P,
whose window reads positions >= P - w + 1: the blocks from `num_out_of_window(P)` on (the *decode need*). A
checkpoint after k blocks is a hit only beside window blocks [k - span, k), so a received checkpoint is worth
registering only with those blocks too. Without a state group a hit may end at any block boundary: the
deepest full block's end stands in for the checkpoints (`hit_positions`).

Prefill side: the request's live window table (blocks before its window are null there, freed while it ran) is
held as it is, and extended back through blocks still cached by hash, as far as the offered checkpoints need:
those are touched, so they cannot be evicted until the hold is released. What is held is always one run, from
`start` to the end of the prompt's table; the offer names `start` (the hashes follow from the prompt, which
the offer's digest fixes).

Decode side: its table for the request is null before a `start` of its own (no earlier than the offer's, no
later than the decode need, as early as the wanted checkpoints ask), then the run of window blocks it already
caches from there (shared, not sent), then fresh blocks that receive the rest. `CacheManager.commit` registers
the received full blocks by hash, like a step's; the request's first step frees those before its window, which
stay findable. Always one null run then live blocks: a valid window table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recap.core.block_pool import NULL_BLOCK_ID
from recap.core.cache_manager import CacheManager
from recap.core.kv_manager import cdiv
from recap.core.request import Request
from recap.core.window_manager import WindowManager


@dataclass(frozen=True)
class WindowHold:
    """A held request's window blocks: `block_ids` is its prompt's window table, null before `start`."""

    start: int  # first prompt block held (every one from here to the end of the table is)
    block_ids: tuple[int, ...]
    extra: tuple[int, ...]  # cached blocks before the request's live table, touched for the hold


def checkpoint_needs(window: WindowManager, position: int) -> int:
    """The first window block a hit at `position` (a block boundary) reads."""
    return max(0, position // window.block_size - window.span)


def hit_positions(cache: CacheManager, num_prompt: int, checkpoints: Sequence[int]) -> list[int]:
    """The positions a later hit on the received prompt can end at: the checkpoints with a state group; without
    one every block boundary is, and the deepest full block's end is the one to keep the window for."""
    if cache.state is not None:
        return list(checkpoints)
    deepest = num_prompt // cache.block_size * cache.block_size
    return [deepest] if cache.enable_caching and deepest else []


def hold_window(cache: CacheManager, request: Request, positions: Sequence[int]) -> WindowHold | None:
    """Keep the request's window table and touch the cached blocks before it that checkpoints at `positions`
    need (a run back from the table's first live block; it stops at the first one evicted). None without a
    window group."""
    window = cache.window
    if window is None:
        return None
    rid, hashes = request.request_id, request.block_hashes
    table = list(window.tables[rid])
    num_null = window.num_null(rid)
    lowest = min([num_null, *(checkpoint_needs(window, p) for p in positions)])
    start, extra = num_null, []
    while start > lowest and start - 1 < len(hashes):
        block_id = window.pool.lookup(hashes[start - 1])
        if block_id is None:
            break
        extra.append(block_id)
        start -= 1
    extra.reverse()
    window.pool.touch(extra)
    table[start:num_null] = extra
    return WindowHold(start, tuple(table), tuple(extra))


def release_window(cache: CacheManager, hold: WindowHold | None) -> None:
    """Drop the hold's touches (after the request's own table was freed: its deeper blocks go first)."""
    if hold is not None and hold.extra:
        assert cache.window is not None
        cache.window.pool.free(hold.extra)


def check_window_offer(window: WindowManager | None, num_prompt: int, start: int | None) -> None:
    """Raise ValueError unless an offer's window blocks (`start` to the end) let this side decode the prompt."""
    if window is None:
        if start is not None:
            raise ValueError("the prefill side runs a model with sliding-window layers, this side does not")
        return
    if start is None:
        raise ValueError("this side's model has sliding-window layers, the prefill side sent none")
    need = window.num_out_of_window(num_prompt)
    if not 0 <= start <= need:
        raise ValueError(f"the prefill side holds window blocks from block {start}; the next token reads "
                         f"block {need} on")


def receive_start(window: WindowManager, num_prompt: int, offer_start: int, positions: Sequence[int]) -> int:
    """Where the decode side's live window table starts: early enough for the checkpoints at `positions`
    (those past its own best), never before what the prefill side holds, never past the decode need."""
    need = window.num_out_of_window(num_prompt)
    return max(offer_start, min([need, *(checkpoint_needs(window, p) for p in positions)]))


def window_head(cache: CacheManager, request: Request, start: int) -> list[int]:
    """The table's known part: null before `start`, then the run of full blocks this side caches already."""
    window = cache.window
    assert window is not None
    head = [NULL_BLOCK_ID] * start
    if cache.enable_caching:
        hashes, full = request.block_hashes, request.num_prompt_tokens // cache.block_size
        for i in range(start, min(full, len(hashes))):
            block_id = window.pool.lookup(hashes[i])
            if block_id is None:
                break
            head.append(block_id)
    return head


@dataclass(frozen=True)
class WindowReceive:
    """The window blocks to receive: prompt block `indices[j]` lands in `block_ids[j]`, hashed `hashes[j]`
    (None for a partial block or without caching)."""

    indices: tuple[int, ...] = ()
    block_ids: tuple[int, ...] = ()
    hashes: tuple[int | None, ...] = ()


def admit_window(cache: CacheManager, request: Request, head: Sequence[int]) -> WindowReceive:
    """Take the request's window table (`head`, then fresh blocks to the prompt's end): what to receive."""
    window = cache.window
    assert window is not None
    rid, num_prompt, hashes = request.request_id, request.num_prompt_tokens, request.block_hashes
    window.admit(rid, head, num_prompt)
    table = window.tables[rid]
    indices = tuple(range(len(head), cdiv(num_prompt, cache.block_size)))
    return WindowReceive(indices, tuple(table[i] for i in indices),
                         tuple(hashes[i] if i < len(hashes) else None for i in indices))
