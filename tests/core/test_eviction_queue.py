"""The state pool over the fast eviction queue, over the plain reference queue, and the replay's inlined pool:
random ask / register / touch / pin / strand / drop sequences give the same slots, evictions and inflation."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.bench.replay_pool import ReplayStatePool
from recap.core.eviction_queue import EvictionQueue, ReferenceEvictionQueue
from recap.core.output import CheckpointWrite
from recap.core.state_pool import PlannedWrite, SlotKind, StatePool

BS = 2
HASHES = st.integers(0, 24)  # few keys: repeats, duplicates and re-registrations are common

ask = st.tuples(HASHES, st.integers(-2, 40), st.booleans(), st.booleans())  # hash, value, proven, written
# Weighted by repetition: most operations are chunks asking for slots; a reset is rare.
NAMES = ["ask"] * 8 + ["running", "free", "touch", "touch", "pin", "unpin", "strand", "drop"] * 2 + ["reset"]
OPS = st.tuples(st.sampled_from(NAMES), st.integers(0, 50), st.lists(ask, min_size=1, max_size=9))


def fast(num_slots: int) -> StatePool:
    return StatePool(num_slots, BS, bytes_per_slot=3, flops_per_token=2.0)


def reference(num_slots: int) -> StatePool:
    return StatePool(num_slots, BS, bytes_per_slot=3, flops_per_token=2.0, queue=ReferenceEvictionQueue)


def replay(num_slots: int) -> StatePool:
    return ReplayStatePool.adopt(fast(num_slots))


def ask_and_register(pool: StatePool, asks: list[tuple[int, int, bool, bool]]) -> list[object]:
    """One chunk: slots for each ask (hash at position (i + 1) * BS), then register the written ones."""
    chain = [h for h, _, _, _ in asks]
    values = [float(v if v > 0 else (i + 1) * BS) for i, (_, v, _, _) in enumerate(asks)]
    slots = pool.allocate_checkpoints(zip(chain, values, (p for _, _, p, _ in asks)))
    plans, written = [], []
    for i, ((h, v, p, w), slot) in enumerate(zip(asks, slots)):
        if slot is not None:
            write = CheckpointWrite((i + 1) * BS, slot)
            plans.append(PlannedWrite(write, h, proven=p, source=i % 3, value_tokens=v))
            written += [write] if w else []
    return [slots, pool.register(plans, written, chain)]


Op = tuple[str, int, list[tuple[int, int, bool, bool]]]


def apply(pool: StatePool, op: str, arg: int, asks: list[tuple[int, int, bool, bool]], running: list[int]) -> object:
    """Do one operation; `arg` picks among the slots it applies to (sorted, so every pool picks the same)."""
    checkpoints = [s for s, kind in enumerate(pool.kind) if kind == SlotKind.CHECKPOINT]
    if op == "ask":
        return ask_and_register(pool, asks)
    if op == "running":
        slot = pool.allocate_running()
        running += [] if slot is None else [slot]
        return slot
    if op == "strand":
        return pool.strand(arg % 25)
    if op == "reset":
        return pool.reset()
    if op == "free":
        return pool.free(running.pop(arg % len(running))) if running else None
    if op == "unpin":
        pinned = [s for s in checkpoints if pool.pins[s]]
        return pool.unpin(pinned[arg % len(pinned)]) if pinned else None
    if not checkpoints:
        return None
    slot = checkpoints[arg % len(checkpoints)]
    if op == "touch":
        return pool.touch(slot)
    if op == "pin":
        return pool.pin(slot)
    assert op == "drop"
    hash_ = pool.slot_hash[slot]
    assert hash_ is not None
    return pool.drop(slot, hash_)


def observed(pool: StatePool, outcomes: list[tuple[int, bool]]) -> tuple[object, ...]:
    pool.check()
    checkpoints = [s for s, kind in enumerate(pool.kind) if kind == SlotKind.CHECKPOINT]
    counts = (pool.num_evicted, pool.num_declined, pool.num_created, pool.num_duplicates, pool.num_refused)
    return (
        list(pool.kind),
        list(pool.slot_hash),
        counts,
        pool.num_already_registered,
        pool.num_stranded,
        pool.inflation,
        [pool.priority(s) for s in checkpoints],
        list(outcomes),
    )


def run(make: Callable[[int], StatePool], num_slots: int, ops: list[Op]) -> list[object]:
    pool = make(num_slots)
    outcomes: list[tuple[int, bool]] = []
    pool.on_outcome = lambda source, hit: outcomes.append((source, hit))
    running: list[int] = []
    trail: list[object] = []
    for op, arg, asks in ops:
        trail.append((op, apply(pool, op, arg, asks, running)))
        trail.append(observed(pool, outcomes))
    return trail


@settings(max_examples=300)
@given(num_slots=st.integers(1, 7), ops=st.lists(OPS, min_size=4, max_size=60))
def test_fast_queue_and_replay_pool_match_the_reference(num_slots: int, ops: list[Op]) -> None:
    expected = run(reference, num_slots, ops)
    assert run(fast, num_slots, ops) == expected
    assert run(replay, num_slots, ops) == expected


def test_the_fast_queue_compacts_stale_entries_without_reordering() -> None:
    """Many touches of a few slots leave stale entries; compaction keeps them bounded and the order intact."""
    pins = [0] * 3
    fast_queue, plain = EvictionQueue(3, pins), ReferenceEvictionQueue(3, pins)
    for q in (fast_queue, plain):
        q.push([0, 1, 2], [5.0, 5.0, 7.0])
        for i in range(400):
            q.push([i % 3], [float(i % 4)])
    assert fast_queue.num_entries <= 4 * 3 + 64
    fast_queue.check({0, 1, 2})
    for _ in range(3):
        top = plain.top()
        assert top is not None and fast_queue.top() == top
        fast_queue.evict(top[1], top[0])
        plain.evict(top[1], top[0])
        assert fast_queue.inflation == plain.inflation
    assert fast_queue.top() is None and plain.top() is None
