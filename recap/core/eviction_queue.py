"""The state pool's eviction order: checkpoint slots by GreedyDual priority, the lowest (priority, push) first.

Two implementations of one contract (`EvictionOrder`): `EvictionQueue`, FIFO buckets per priority under a
heap of the distinct priorities (a chunk's checkpoints under policy `all` share one priority, so a push or an
eviction is a deque operation, not a heap operation on tuples), and `ReferenceEvictionQueue`, a plain map
scanned for its minimum. tests/core/test_eviction_queue.py drives a `StatePool` over each (and the replay's
inlined pool, recap/bench/replay_pool.py) through random sequences and asserts the same slots, evictions and
inflation.

`inflation` is GreedyDual's L: the priority of the last eviction or refusal, added to every new priority so
that recency enters the order. Pinned slots (`pins[slot] > 0`, a list the pool owns and updates) are never
the top.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import Protocol


class EvictionOrder(Protocol):
    """What the state pool needs of its eviction order (one entry per checkpoint slot)."""

    inflation: float

    def push(self, slots: Iterable[int], utilities: Iterable[float]) -> None: ...

    def discard(self, slot: int) -> None: ...

    def top(self) -> tuple[float, int] | None: ...

    def evict(self, slot: int, priority: float) -> None: ...

    def decline(self, priority: float) -> None: ...

    def priority(self, slot: int) -> float: ...

    def compact(self) -> None: ...

    def check(self, checkpoints: set[int]) -> None: ...


class EvictionQueue:
    """Buckets of entries per priority under a heap of priorities; stale entries dropped lazily.

    An entry is an int, push sequence * num_slots + slot, queued in push order in its priority's bucket
    (never empty). An entry is live while it is its slot's latest (`latest[slot]`, -1 once discarded);
    stale entries are dropped when met at the front of the lowest bucket, and by `compact`. The fields are
    public for the replay's inlined loops (recap/bench/replay_pool.py), which keep these invariants.
    """

    def __init__(self, num_slots: int, pins: list[int]) -> None:
        self.num_slots = num_slots
        self.pins = pins
        self.priorities: list[float] = []  # a heap of the bucketed priorities
        self.buckets: dict[float, deque[int]] = {}
        self.latest = [-1] * num_slots
        self.seq = 0
        self.num_entries = 0  # queued entries, live or stale
        self.num_live = 0  # slots with a live entry
        self.inflation = 0.0

    def push(self, slots: Iterable[int], utilities: Iterable[float]) -> None:
        """Queue each slot at priority inflation + its utility, in order; a slot's older entry goes stale.

        Many at once: registering a chunk under policy `all` pushes one per block, so the loop is inlined.
        """
        latest, buckets, n, inflation = self.latest, self.buckets, self.num_slots, self.inflation
        seq = self.seq
        for slot, utility in zip(slots, utilities, strict=True):
            self.num_live += latest[slot] < 0
            seq += 1
            latest[slot] = entry = seq * n + slot
            priority = inflation + utility
            bucket = buckets.get(priority)
            if bucket is None:
                bucket = buckets[priority] = deque()
                heapq.heappush(self.priorities, priority)
            bucket.append(entry)
            self.num_entries += 1
        self.seq = seq
        self.bound_stale()

    def bound_stale(self) -> None:
        """Compact once stale entries outnumber live ones four to one (a bound on memory, not on order)."""
        if self.num_entries > 4 * self.num_live + 64:
            self.compact()

    def discard(self, slot: int) -> None:
        """`slot` is no longer a checkpoint: its entry goes stale."""
        assert self.latest[slot] >= 0, f"slot {slot} is not queued"
        self.latest[slot] = -1
        self.num_live -= 1

    def top(self) -> tuple[float, int] | None:
        """(priority, slot) of the lowest-priority unpinned entry; None if there is none."""
        priorities, buckets, pins, latest, n = self.priorities, self.buckets, self.pins, self.latest, self.num_slots
        while priorities:
            bucket = buckets[priorities[0]]
            entry = bucket[0]
            if latest[entry % n] != entry:
                bucket.popleft()  # stale
                self.num_entries -= 1
                if not bucket:
                    del buckets[heapq.heappop(priorities)]
            elif not pins[entry % n]:
                return priorities[0], entry % n
            else:  # pinned at the front (rare: a hit refreshes what it pins): look past it
                live = [(p, e) for p, q in buckets.items() for e in q if latest[e % n] == e and not pins[e % n]]
                if not live:
                    return None
                priority, entry = min(live)
                return priority, entry % n
        return None

    def evict(self, slot: int, priority: float) -> None:
        """Take out `slot`, the top at `priority`; L rises to it."""
        entry = self.latest[slot]
        bucket = self.buckets[self.priorities[0]]
        if bucket[0] == entry:  # an entry found past a pinned one just goes stale
            bucket.popleft()
            self.num_entries -= 1
            if not bucket:
                del self.buckets[heapq.heappop(self.priorities)]
        self.discard(slot)
        if priority > self.inflation:
            self.inflation = priority

    def decline(self, priority: float) -> None:
        """A new checkpoint at `priority` ranked below the top and was refused: L rises to it."""
        if priority > self.inflation:
            self.inflation = priority

    def priority(self, slot: int) -> float:
        """The current priority of queued `slot` (for tests and debugging)."""
        entry = self.latest[slot]
        assert entry >= 0, f"slot {slot} is not queued"
        return next(p for p, q in self.buckets.items() if entry in q)

    def compact(self) -> None:
        """Drop every stale entry, and the buckets left empty."""
        latest, n = self.latest, self.num_slots
        for priority, bucket in list(self.buckets.items()):
            live = [e for e in bucket if latest[e % n] == e]
            if live:
                bucket.clear()  # in place, order kept: hot loops hold the containers
                bucket.extend(live)
            else:
                del self.buckets[priority]
        self.priorities[:] = self.buckets
        heapq.heapify(self.priorities)
        self.num_entries = sum(map(len, self.buckets.values()))

    def check(self, checkpoints: set[int]) -> None:
        """Assert the queued slots are exactly `checkpoints` and the counts agree."""
        n = self.num_slots
        live = {e % n for q in self.buckets.values() for e in q if self.latest[e % n] == e}
        assert live == checkpoints, "a checkpoint is missing from the eviction buckets"
        assert {s for s, e in enumerate(self.latest) if e >= 0} == checkpoints, "a stale slot is still queued"
        assert self.num_live == len(checkpoints), "live entries miscounted"
        assert sorted(self.priorities) == sorted(self.buckets) and all(self.buckets.values()), "a bucket is lost"
        assert self.num_entries == sum(map(len, self.buckets.values())), "queued entries miscounted"


class ReferenceEvictionQueue:
    """The plain order: a map slot -> (priority, push sequence), its unpinned minimum found by a scan."""

    def __init__(self, num_slots: int, pins: list[int]) -> None:
        self.pins = pins
        self.entries: dict[int, tuple[float, int]] = {}
        self.seq = 0
        self.inflation = 0.0

    def push(self, slots: Iterable[int], utilities: Iterable[float]) -> None:
        for slot, utility in zip(slots, utilities, strict=True):
            self.seq += 1
            self.entries[slot] = (self.inflation + utility, self.seq)

    def discard(self, slot: int) -> None:
        del self.entries[slot]

    def top(self) -> tuple[float, int] | None:
        unpinned = [(priority, seq, slot) for slot, (priority, seq) in self.entries.items() if not self.pins[slot]]
        if not unpinned:
            return None
        priority, _, slot = min(unpinned)
        return priority, slot

    def evict(self, slot: int, priority: float) -> None:
        del self.entries[slot]
        self.inflation = max(self.inflation, priority)

    def decline(self, priority: float) -> None:
        self.inflation = max(self.inflation, priority)

    def priority(self, slot: int) -> float:
        return self.entries[slot][0]

    def compact(self) -> None:
        """Nothing goes stale here."""

    def check(self, checkpoints: set[int]) -> None:
        assert set(self.entries) == checkpoints, "a checkpoint is missing from the eviction order"
