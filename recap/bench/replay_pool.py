"""The replay's state pool: `StatePool` with its allocation loop inlined over the eviction queue's fields.

Policy `all` asks for millions of checkpoint slots in a trace replay, nearly each one an eviction; the
engine core's `StatePool.allocate_checkpoints` spends most of that in calls (the queue's top, evict and
discard, the pool's unregister). This subclass does the same work in one loop with locals bound once per
chunk, so the speed-up stays with the replay and the core keeps the plain calls.
tests/core/test_eviction_queue.py asserts it gives the same slots, evictions and inflation as the core
pool over both queues.
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heappop

from recap.core.eviction_queue import EvictionQueue
from recap.core.state_pool import SlotKind, StatePool


class ReplayStatePool(StatePool):
    """A `StatePool` over an `EvictionQueue` whose `allocate_checkpoints` is one inlined loop."""

    _queue: EvictionQueue

    @classmethod
    def adopt(cls, pool: StatePool) -> ReplayStatePool:
        """Turn a fresh core pool (no slot handed out yet) into this class in place, keeping every reference."""
        assert type(pool) is StatePool and isinstance(pool._queue, EvictionQueue), "adopt a core pool"
        assert pool.num_free == pool.num_slots, "adopt the pool before the first allocation"
        pool.__class__ = cls
        assert isinstance(pool, ReplayStatePool)
        return pool

    def allocate_checkpoints(self, asks: Iterable[tuple[int | None, float, bool]]) -> list[int | None]:
        """`StatePool.allocate_checkpoints`, with `_allocate`, the queue's top/evict and `_unregister` inlined."""
        queue = self._queue
        free, by_hash, kind, pins, num_slots = self._free, self._by_hash, self.kind, self.pins, self.num_slots
        priorities, buckets, latest = queue.priorities, queue.buckets, queue.latest
        slot_hash, slot_hits, slot_source = self.slot_hash, self.slot_hits, self.slot_source
        pending, per_token, on_outcome = SlotKind.PENDING, self._value_per_token, self.on_outcome
        inflation, num_evicted = queue.inflation, 0  # stored back once: nothing called in the loop reads them
        out: list[int | None] = []
        for block_hash, value, proven in asks:
            if block_hash in by_hash:
                self.num_already_registered += 1
                out.append(None)
                continue
            if free:
                slot = free.pop()
            else:
                bucket = buckets[priorities[0]] if priorities else None
                entry = bucket[0] if bucket else -1  # the lowest (priority, sequence)
                slot = entry % num_slots
                if entry >= 0 and latest[slot] == entry and not pins[slot]:
                    top_priority = priorities[0]
                else:
                    top = queue.top()  # stale or pinned entries at the front: the slow path
                    if top is None:
                        self.num_declined += 1
                        out.append(None)
                        continue
                    top_priority, slot = top
                    entry = latest[slot]
                    bucket = buckets[priorities[0]]
                priority = inflation + value * per_token * (1 + proven)  # utility(), inlined
                if priority < top_priority:
                    inflation = max(inflation, priority)
                    self.num_declined += 1
                    out.append(None)
                    continue
                if bucket[0] == entry:  # evict it; an entry found past a pinned one just goes stale
                    bucket.popleft()
                    queue.num_entries -= 1
                    if not bucket:
                        del buckets[heappop(priorities)]
                latest[slot] = -1  # queue.discard(slot)
                queue.num_live -= 1
                inflation = max(inflation, top_priority)
                if self.on_spill is not None:  # a lower tier saves what leaves (replay_tiers.py)
                    self.on_spill(slot, slot_hash[slot], self.slot_position[slot], False)  # type: ignore[arg-type]
                owner = by_hash.pop(slot_hash[slot], None)  # type: ignore[arg-type]  # _unregister(slot), inlined
                assert owner == slot, f"evicted checkpoint {slot} is not mapped by its hash"
                if on_outcome is not None and slot_hits[slot] == 0 and self.on_spill is None:  # demoted: no miss
                    on_outcome(slot_source[slot], False)
                slot_hash[slot] = None
                num_evicted += 1
            kind[slot] = pending
            out.append(slot)
        queue.inflation = inflation
        self._num_checkpoints -= num_evicted
        self.num_evicted += num_evicted
        return out
