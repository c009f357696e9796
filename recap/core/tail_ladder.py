"""The tail ladder: where a request checkpoints before its prompt end, given where recent requests diverged.

Inputs are the recent divergence distances (tokens before an earlier prompt's end at which a later request
left its chain; core/policy.py observes them) and the prompt end E of the request being placed. A checkpoint
at E - x serves every later request diverging d <= x tokens before E and saves it E - x tokens, so a ladder
of distances x_1 < x_2 < ... saves, summed over the recent divergences d, E - (the smallest x_i >= d); a
divergence past every rung (or at d >= E) saves nothing.

`greedy_ladder` adds rungs one at a time, each the one that adds the most expected saving. The rungs split
the sorted distances into independent gaps (a gap's divergences are served by the rung above it, or by
nothing), so a new rung only changes its own gap: the best split of each gap is kept in a heap, and a run of
m rungs costs O(n log n) over n distinct distances. Its first rung is argmax_x F(x) (E - x), the single
tail of the first policy; `ladder_reference` is the plain O(m n^2) greedy it is tested against.

`ladder_size` picks how many rungs to write from the capacity that holds them: with C checkpoints of lower
tiers (LRU) and w + m checkpoints written per request, a checkpoint lives about C / (w + m) requests. The
ladder takes the most rungs that still keep every checkpoint for the longest recent reuse interval (the
requests between a chain's writer and a later sharer): a rung pays only if it is still held when its
sharer comes, and so do the branch points and tails the rungs would push out. (Weighing the rungs' saving
against the share of reuses they outlive, which ignores what they push out, overfilled a 0.25 TB tier on
the Mooncake trace: 62.9% against 63.3% with one rung; docs/replay.md.)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def _best_split(values: Sequence[int], counts: Sequence[int], lo: int, hi: int, upper: int) -> tuple[int, int]:
    """(gain, index) of the best rung in values[lo:hi] whose divergences the rung at `upper` (or E) serves.

    A rung at values[j] saves upper - values[j] more to each divergence in values[lo:j+1]; ties keep the
    shorter distance. (0, -1) when no rung gains.
    """
    best, choice, below = 0, -1, 0
    for j in range(lo, hi):
        below += counts[j]
        gain = below * (upper - values[j])
        if gain > best:
            best, choice = gain, j
    return best, choice


def _histogram(distances: Sequence[int], end: int) -> tuple[list[int], list[int]]:
    """The distinct distances below `end`, ascending, and how often each occurs."""
    values: list[int] = []
    counts: list[int] = []
    for d in sorted(distances):
        if d >= end:
            break
        if values and values[-1] == d:
            counts[-1] += 1
        else:
            values.append(d)
            counts.append(1)
    return values, counts


def greedy_ladder(distances: Sequence[int], end: int, max_rungs: int) -> list[tuple[int, int]]:
    """Up to `max_rungs` (distance, added saving) pairs, in the order the greedy adds them; only gaining rungs."""
    values, counts = _histogram(distances, end)
    out: list[tuple[int, int]] = []
    heap: list[tuple[int, int, int, int, int]] = []  # (-gain, index, lo, hi, upper): index orders equal gains

    def push(lo: int, hi: int, upper: int) -> None:
        gain, j = _best_split(values, counts, lo, hi, upper)
        if j >= 0:
            heapq.heappush(heap, (-gain, j, lo, hi, upper))

    push(0, len(values), end)
    while heap and len(out) < max_rungs:
        neg_gain, j, lo, hi, upper = heapq.heappop(heap)
        out.append((values[j], -neg_gain))
        push(lo, j, values[j])  # below the new rung: served by it now
        push(j + 1, hi, upper)  # above it: still served by the rung above (or by nothing)
    return out


def ladder_reference(distances: Sequence[int], end: int, max_rungs: int) -> list[tuple[int, int]]:
    """The plain greedy: each round tries every distance against the total saving of the whole ladder."""

    def saving(rungs: list[int]) -> int:
        return sum(end - min((x for x in rungs if x >= d), default=end) for d in distances if d < end)

    rungs: list[int] = []
    out: list[tuple[int, int]] = []
    candidates = sorted({d for d in distances if d < end})
    while len(out) < max_rungs:
        base = saving(rungs)
        best, choice = 0, -1
        for x in candidates:
            gain = saving(rungs + [x]) - base
            if x not in rungs and gain > best:
                best, choice = gain, x
        if choice < 0:
            break
        rungs.append(choice)
        out.append((choice, best))
    return out


def ladder_size(num_rungs: int, longest_interval: int, capacity: int, base_writes: float) -> int:
    """The most rungs m <= num_rungs with capacity / (base_writes + m) >= longest_interval, at least one.

    `longest_interval`: the longest recent reuse interval in requests (0: none seen, nothing to weigh: one
    rung, the single tail); `capacity`: checkpoints the lower tiers hold; `base_writes`: checkpoints a
    request writes besides its rungs.
    """
    if num_rungs <= 0:
        return 0
    if longest_interval <= 0 or capacity <= 0:
        return 1
    return max(1, min(num_rungs, math.floor(capacity / longest_interval - base_writes)))
