"""Checkpoint policies: at which block boundaries a request's SSM state is checkpointed (DESIGN 4).

Positions are absolute token counts p (a multiple of block_size): "the state after p tokens".
  prompt end:  ((prompt_len - 1) // bs) * bs, the last boundary strictly before the prompt's last token;
  decode end:  the last boundary a chunk reaches at or past the prompt length, written as a provisional
               snapshot that the request's next one supersedes (so a finished request keeps its last);
  segments:    Request.segment_boundaries rounded down to a boundary;
  branch:      the KV-hit end when the KV hit ran past the best checkpoint at admission, and the end of
               the prefix earlier requests computed when it runs past the KV hit (blocks KV evicted
               but whose hashes it still remembers: a recurring document outlives its KV);
  interval:    every `checkpoint_interval` blocks;
  geometric:   1, 2, 4, ... blocks after the start and after each segment boundary, inside the prompt;
  tail:        the prompt end minus a learned divergence distance (below).
Learned tail: when a request's KV hit ends at h inside a chain that an earlier request extended to its
prompt end E, the later request diverged E - h tokens before that end. The policy keeps the recent
distances and checkpoints each new prompt of end E at E - d, choosing d to maximize the expected
saving F(d) * (E - d), F the share of recent distances <= d: a checkpoint at E - d serves every later
request diverging within d of the end and saves E - d tokens to each. A long prompt so reaches far back
(losing d tokens costs it little), a short one stays near its end. Where requests extend whole prompts
(chat turns) the distances are ~0 and the tail is the prompt end; where they share only part of the tail
(a re-rendered last message, a trace hashed on a coarser grid, a document with different questions)
the tail lands inside the shared part on the first sharing, not one turn late. A tail at or before a
proven position of the same request is not written: that position is the measured version of it.
Tail ladder: where lower tiers exist (`tier_capacity` checkpoints, set by core/tiers.py), one tail misses
every sharer that diverges between it and the prompt end, and the first sharer of a chain whose tail lies
past its divergence. The tail then becomes a ladder of rungs E - x_1 > E - x_2 > ..., added greedily by
expected saving over the same recent distances (the first rung is the single tail), as many as still let
the tiers keep every checkpoint for the longest recent reuse interval (requests between a chain's writer
and a sharer) when every request writes that many more (core/tail_ladder.py). Without lower tiers the
ladder is the single tail: the read pool's slots are rationed by value and learned yield.
Sharing evidence makes a checkpoint "proven" (segment boundaries, learned branch points): the state
pool protects those from speculative ones (state_pool.py).
Learned yield: the state pool reports, per source, whether each checkpoint was hit before it left.
A speculative source (prompt end, decode end, tail, interval, geometric) whose checkpoints almost
never pay on the current traffic is written only for one request in EXPLORE_EVERY, so its slots go
to sources that do pay; it comes back as soon as its sampled checkpoints start hitting again.
Policy `none` writes nothing, `align` the prompt end, `all` every boundary, `recap` everything above
(interval and geometric only when configured). Positions never constrain chunk sizes: a chunk gets
the positions that fall inside it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from recap.config import CacheConfig
from recap.core.request import Request
from recap.core.tail_ladder import greedy_ladder, ladder_size

TAIL_WINDOW = 256  # recent divergence distances kept
# Block hashes remembered with the prompt end that last extended them. A request reads the entry at the
# end of its KV hit (or seen prefix), so only hashes the cache still indexes are read again: past
# `extent_capacity` entries the map drops those the cache no longer holds (`holds`), keeping the hashes of
# requests still running. The cache manager passes twice its index's size, so a sweep frees at least
# half the map (amortised O(1) per entry). Bounding by a count alone (LRU by write) forgot hot prefixes,
# a shared system prompt written once and hit ever after, while KV still held them (docs/replay.md).
# Without `holds` (or if running requests alone fill it) the least recently written entries go.
EXTENT_CAPACITY = 1 << 20

YIELD_MIN_SAMPLES = 64  # outcomes of a source before its yield is trusted
YIELD_MIN_RATE = 1 / 32  # below this hit rate a speculative source is only sampled
EXPLORE_EVERY = 16


class Source(enum.IntEnum):
    """Why a position is checkpointed; lower values win when several coincide."""

    SEGMENT = 0
    BRANCH = 1
    TAIL = 2
    PROMPT_END = 3
    DECODE_END = 4
    INTERVAL = 5
    GEOMETRIC = 6
    EVERY_BLOCK = 7  # policy "all"
    REMOTE = 8  # received from a prefill instance
    TIER = 9  # promoted from a lower tier (core/tiers.py)
    LADDER = 10  # a further tail rung, written only where lower tiers hold them (core/tail_ladder.py)


PROVEN_SOURCES = frozenset({Source.SEGMENT, Source.BRANCH})


class Position(NamedTuple):
    position: int
    provisional: bool  # a decode-end snapshot the request's next one supersedes
    proven: bool  # sharing was observed or declared there
    source: Source


class CheckpointPolicy:
    """Per-request checkpoint positions.

    Side effects: `admit` records the positions a request should checkpoint (including a learned
    branch point); `forget` drops them.
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        has_state: bool,
        extent_capacity: int = EXTENT_CAPACITY,
        holds: Callable[[int], bool] | None = None,
    ) -> None:
        """`extent_capacity`: block hashes the tail learner remembers before it sweeps; `holds(hash)`: whether
        the cache still indexes a block hash (entries it does not are what a sweep drops)."""
        if extent_capacity < 1:
            raise ValueError(f"extent_capacity must be positive, got {extent_capacity}")
        self.name = cache_config.checkpoint_policy
        self.block_size = cache_config.block_size
        self.enabled = has_state and cache_config.enable_prefix_caching and self.name != "none"
        # Policy `all`: every boundary is a plain checkpoint (Source.EVERY_BLOCK). The cache manager plans
        # them from `boundaries`, without a Position each: millions per trace replay.
        self.every_block = self.enabled and self.name == "all"
        interval = cache_config.checkpoint_interval if self.name == "recap" else None
        self._interval = interval * self.block_size if interval else 0
        self._geometric = self.name == "recap" and cache_config.checkpoint_geometric
        self._static: dict[str, dict[int, Source]] = {}
        self._decode: dict[str, bool] = {}  # decode-end snapshots wanted for this request
        self.num_branch_points = 0
        self._learn_tail = self.name == "recap"
        self.learns_yield = self.enabled and self.name == "recap"  # wants the state pool's per-source outcomes
        # block hash -> (prompt end, admission serial) of its last extender
        self._extent: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.extent_capacity = extent_capacity
        self._holds = holds
        self._writing: dict[str, tuple[Sequence[int], int, int]] = {}  # request -> (hashes, start, stop) it wrote
        self.num_extent_sweeps = 0
        # Per cache salt: tenants learn from their own traffic only (salts isolate, DESIGN invariant 6).
        self._distances: dict[str | None, deque[int]] = {}
        self._intervals: dict[str | None, deque[int]] = {}  # requests between a chain's writer and a sharer
        self.tier_capacity = 0  # checkpoints the lower tiers hold: the tail ladder's budget (0: one tail)
        self._serial = 0  # requests admitted (recap): the clock of reuse intervals
        self._num_sites = 0  # positions other than ladder rungs, over admitted requests: writes per request
        self.num_ladder_rungs = 0  # rungs past the single tail, written or not
        self.outcomes: dict[Source, list[int]] = {src: [0, 0] for src in Source}  # [hits, misses]
        self._explore: dict[Source, int] = {src: 0 for src in Source}

    def prompt_end(self, request: Request) -> int:
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    # -- learned yield ---------------------------------------------------------------------------
    def record_outcome(self, source: int, hit: bool) -> None:
        """The state pool reports a checkpoint's first hit, or its departure without one."""
        self.outcomes[source][0 if hit else 1] += 1  # an IntEnum key: the int finds it

    def pays(self, source: Source) -> bool:
        """Whether to write this source's checkpoints for the next request (sampled when it does not pay)."""
        if source in PROVEN_SOURCES or self.name != "recap":
            return True
        hits, misses = self.outcomes[source]
        if hits + misses < YIELD_MIN_SAMPLES or hits >= YIELD_MIN_RATE * (hits + misses):
            return True
        self._explore[source] += 1
        return self._explore[source] % EXPLORE_EVERY == 0

    # -- positions ------------------------------------------------------------------------------
    def admit(self, request: Request, hit_tokens: int, kv_hit_tokens: int, seen_tokens: int = 0) -> None:
        """Record the request's fixed positions; learn a branch point where its KV hit, or the prefix
        earlier requests computed (`seen_tokens`, KV evicted since included), ran past the hit."""
        if not self.enabled or self.name == "all":
            return
        bs = self.block_size
        end = self.prompt_end(request)
        sites: dict[int, Source] = {}

        def add(position: int, source: Source) -> None:
            if position > 0 and source < sites.get(position, len(Source)):
                sites[position] = source

        wanted = {src: self.pays(src) for src in (Source.PROMPT_END, Source.TAIL, Source.GEOMETRIC, Source.INTERVAL)}
        if wanted[Source.PROMPT_END] or self.name == "align":
            add(end, Source.PROMPT_END)
        if self.name == "recap":
            segments = {b // bs * bs for b in request.segment_boundaries if bs <= b <= request.num_prompt_tokens}
            for b in segments:
                add(b, Source.SEGMENT)
            if kv_hit_tokens > hit_tokens:
                add(kv_hit_tokens, Source.BRANCH)
                self.num_branch_points += 1
            if self._geometric and wanted[Source.GEOMETRIC]:
                for g in self._geometric_positions(sorted(segments | {0}), end):
                    add(g, Source.GEOMETRIC)
            tails = self._tail(request, kv_hit_tokens, end)
            measured = max((p for p, src in sites.items() if src in PROVEN_SOURCES), default=0)
            if wanted[Source.TAIL]:
                for i, tail in enumerate(tails):
                    if tail > max(hit_tokens, measured):
                        add(tail, Source.TAIL if i == 0 else Source.LADDER)
            if seen_tokens > max(kv_hit_tokens, hit_tokens):
                # Shared past the KV hit, through blocks KV evicted: this request recomputes the prefix
                # and diverges there. Not a bound on the tail, unlike a KV branch point: with one, the
                # 80 GB sweep fell by a point (the request's own successors diverge past it).
                add(seen_tokens, Source.BRANCH)
                self.num_branch_points += 1
            if self._interval and wanted[Source.INTERVAL]:
                for p in range(self._interval, request.num_prompt_tokens + 1, self._interval):
                    add(p, Source.INTERVAL)
        self._static[request.request_id] = sites
        self._decode[request.request_id] = self.name == "recap" and self.pays(Source.DECODE_END)
        if self.name == "recap":
            self._serial += 1
            self._num_sites += sum(src != Source.LADDER for src in sites.values()) + self._decode[request.request_id]

    def observe_divergence(self, distance: int, cache_salt: str | None = None, interval: int | None = None) -> None:
        """A request diverged `distance` tokens before the prompt end of the chain it shared, `interval`
        requests after that chain's writer was admitted."""
        self._distances.setdefault(cache_salt, deque(maxlen=TAIL_WINDOW)).append(distance)
        if interval is not None:
            self._intervals.setdefault(cache_salt, deque(maxlen=TAIL_WINDOW)).append(interval)

    def tail_distance(self, prompt_end: int, cache_salt: str | None = None) -> int:
        """The learned divergence distance for a prompt ending at `prompt_end` (a multiple of block_size).

        argmax over the recent distances d of F(d) * (prompt_end - d); 0 before any sharing was seen.
        """
        rungs = greedy_ladder(self._distances.get(cache_salt, ()), prompt_end, 1)
        return -(-rungs[0][0] // self.block_size) * self.block_size if rungs else 0

    def tail_distances(self, prompt_end: int, cache_salt: str | None = None) -> list[int]:
        """The ladder's distances (block multiples), the single tail's first; [0] before any sharing was seen.

        More than one only with lower tiers: as many greedy rungs as `ladder_size` finds worth their slots.
        """
        distances = self._distances.get(cache_salt, ())
        rungs = greedy_ladder(distances, prompt_end, len(distances) if self.tier_capacity > 0 else 1)
        if not rungs:
            return [0]
        if len(rungs) > 1:
            longest = max(self._intervals.get(cache_salt, ()), default=0)
            writes = self._num_sites / self._serial if self._serial else 1.0
            rungs = rungs[: ladder_size(len(rungs), longest, self.tier_capacity, writes)]
        bs = self.block_size
        return [-(-x // bs) * bs for x, _ in rungs]

    def _tail(self, request: Request, kv_hit_tokens: int, end: int) -> list[int]:
        """Observe this request's divergence from the chain it shares; return its own tail positions (the
        single tail first, then further ladder rungs)."""
        if not self._learn_tail or end <= 0:
            return []
        bs, hashes, extent = self.block_size, request.block_hashes, self._extent
        k = kv_hit_tokens // bs
        if 0 < k <= len(hashes):
            previous = extent.get(hashes[k - 1])
            if previous is not None:
                previous_end, writer = previous
                self.observe_divergence(max(0, previous_end - kv_hit_tokens), request.cache_salt, self._serial - writer)
        mark = (end, self._serial)  # one tuple per request, shared by its entries
        for h in hashes[k : end // bs]:  # the new part of the chain now ends at this prompt's end
            extent[h] = mark
            extent.move_to_end(h)
        if end // bs > k:  # not cached yet: a sweep must keep them while the request runs
            self._writing[request.request_id] = (hashes, k, end // bs)
        if len(extent) > self.extent_capacity:
            self._bound_extent()
        tails = [max(0, end - x) for x in self.tail_distances(end, request.cache_salt)]
        self.num_ladder_rungs += len(tails) - 1
        return tails

    def _bound_extent(self) -> None:
        """Drop the entries whose hashes the cache no longer holds (running requests' kept), then, if still
        over capacity, the least recently written."""
        extent, holds = self._extent, self._holds
        if holds is not None:
            self.num_extent_sweeps += 1
            live = {h for hashes, start, stop in self._writing.values() for h in hashes[start:stop]}
            for h in [h for h in extent if h not in live and not holds(h)]:
                del extent[h]
        while len(extent) > self.extent_capacity:
            extent.popitem(last=False)

    def _geometric_positions(self, starts: list[int], limit: int) -> set[int]:
        out: set[int] = set()
        for start in starts:
            step = self.block_size
            while start + step <= limit:
                out.add(start + step)
                step *= 2
        return out

    def boundaries(self, start: int, end: int) -> range:
        """Every block boundary in (start, end]."""
        bs = self.block_size
        return range((start // bs + 1) * bs, end + 1, bs)

    def positions(self, request: Request, start: int, end: int) -> list[Position]:
        """The boundaries in (start, end] to checkpoint, sorted."""
        boundaries = self.boundaries(start, end)
        if not boundaries or not self.enabled:
            return []
        if self.every_block:
            # Off the hot path (the cache manager uses plan_every_block): the reference its test compares with.
            return [Position(p, False, False, Source.EVERY_BLOCK) for p in boundaries]
        bs = self.block_size
        rid = request.request_id
        sites = self._static.get(rid, {})
        out = [Position(p, False, src in PROVEN_SOURCES, src) for p in boundaries if (src := sites.get(p)) is not None]
        if self._decode.get(rid, self.name == "recap"):  # requests admitted elsewhere (remote) snapshot too
            last = end // bs * bs
            if last >= request.num_prompt_tokens and not (out and out[-1].position == last):
                out.append(Position(last, True, False, Source.DECODE_END))
        return out

    @property
    def num_extents(self) -> int:
        """Block hashes the tail learner remembers (<= extent_capacity)."""
        return len(self._extent)

    def forget(self, request_id: str) -> None:
        self._static.pop(request_id, None)
        self._writing.pop(request_id, None)
        self._decode.pop(request_id, None)
