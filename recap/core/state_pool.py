"""The state pool: a fixed set of SSM state slots shared by running requests and checkpoints.

A slot is one sequence's conv + SSM state for every SSM layer. Each slot is in exactly one role:
  FREE;
  RUNNING:    a running request reads and updates it in place;
  PENDING:    the destination of a checkpoint the in-flight step writes; not findable yet;
  CHECKPOINT: registered under (h[k], k * block_size) once the writing step completed; immutable;
              evictable unless pinned (a copy from it is in flight).

Eviction is GreedyDual-Size-Frequency over every unpinned checkpoint, in one order:
  priority = L + value x (1 + evidence)
  value    = the compute the checkpoint saves per byte beyond the next shallower checkpoint its writer
             had on the same chain (its hit, or its own previous checkpoint): tokens x FLOPs per token /
             bytes per slot. Measuring from that base, not from 0, is what keeps a one-block-deeper copy
             of a shared prefix (a sibling's tail, a re-asked question) from outranking the checkpoint
             that carries the sharing, while a fresh document's tail, worth its whole length, waits long
             enough for its first sharer.
  evidence = hits so far, plus one when sharing was observed or declared at the position (learned
             branch points, segment boundaries).
  L        = the priority of the last eviction (or refusal), so recency enters through L.
A new checkpoint whose priority would be below every evictable one is refused instead of displacing a
better one (it raises L like an eviction). Equal priorities evict the older entry first.
A checkpoint whose KV block (the one its key names) is evicted is dropped at once (`strand`): a hybrid
hit needs that block, so it could never be used again. At 72 + 8 GB on the Mooncake trace 78% of the
held checkpoints were such orphans; dropping them lets a 2-3 GB state pool do the work of 8 GB.
An eviction into a lower tier (core/tiers.py) is no miss either: the checkpoint may still hit from there.
A stranded checkpoint is not reported to the policy's learned yield as a miss: its KV left, which says
nothing about its position. Reported, it shut off the policy's tails whenever KV was the tight budget,
and a document with no checkpoint is the first KV to go (a feedback loop worth ~0.5 point at 80 GB).
Replaying the Mooncake trace (docs/replay.md) chose this over depth-only GreedyDual (deep one-shot
prompt ends crowd out shallow branch points) and over probation/protected segments (a fresh
document's tail, first shared ~500 requests later, cannot survive a small probation segment).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from operator import eq, itemgetter
from typing import NamedTuple

from recap.core.eviction_queue import EvictionOrder, EvictionQueue
from recap.core.output import CheckpointWrite


class SlotKind(enum.IntEnum):
    FREE = 0
    RUNNING = 1
    PENDING = 2
    CHECKPOINT = 3


class PlannedWrite(NamedTuple):
    """A checkpoint write a step was asked to perform, with what registering it needs."""

    write: CheckpointWrite
    block_hash: int
    # A decode-end snapshot: superseded (dropped) by the request's next one unless it was hit meanwhile.
    provisional: bool = False
    proven: bool = False  # sharing observed or declared here: one hit's worth of evidence
    source: int = 0  # the policy's reason (recap.core.policy.Source), for learned yields
    value_tokens: int = 0  # tokens it saves beyond the request's shallower checkpoint; <= 0: all `position`


class StatePool:
    """Owns every state slot id and the (block hash -> checkpoint slot) map.

    Side effects: `allocate_*` may evict a checkpoint; `register` turns a PENDING slot into a
    CHECKPOINT or frees it; `touch` refreshes a checkpoint's utility; `pin` protects it from eviction.
    """

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        bytes_per_slot: int = 0,
        flops_per_token: float = 1.0,
        queue: Callable[[int, list[int]], EvictionOrder] = EvictionQueue,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        # Told (source, hit) once per checkpoint: at its first hit, or when it leaves unhit.
        self.on_outcome: Callable[[int, bool], None] | None = None
        # Told (slot, hash, position, stranded) of a checkpoint evicted while its data is still in place.
        self.on_spill: Callable[[int, int, int, bool], None] | None = None
        self.slot_source = [0] * num_slots
        self.num_slots = num_slots
        self.block_size = block_size
        self.bytes_per_slot = bytes_per_slot
        self._value_per_token = flops_per_token / max(bytes_per_slot, 1)
        self.kind = [SlotKind.FREE] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._by_hash: dict[int, int] = {}
        self.slot_hash: list[int | None] = [None] * num_slots
        self.slot_position = [0] * num_slots
        self.slot_value_tokens = [0] * num_slots  # tokens saved beyond the writer's shallower checkpoint
        self.slot_proven = [False] * num_slots  # sharing observed or declared at registration: one unit of evidence
        self.pins = [0] * num_slots
        self.slot_hits = [0] * num_slots  # hits since registration
        self._num_pinned = 0
        self._num_checkpoints = 0
        # Eviction order: the lowest (priority, push sequence) unpinned checkpoint first (eviction_queue.py).
        self._queue: EvictionOrder = queue(num_slots, self.pins)
        self.num_created = 0
        self.num_evicted = 0
        self.num_refused = 0  # registrations refused for provenance
        self.num_declined = 0  # checkpoints not written: worth less than every evictable one, or none evictable
        self.num_already_registered = 0  # checkpoints not written: their key is registered already
        self.num_duplicates = 0  # written checkpoints dropped because the key was already registered
        self.num_stranded = 0  # checkpoints dropped because the KV block they end on was evicted

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_checkpoints(self) -> int:
        return self._num_checkpoints

    @property
    def num_evictable(self) -> int:
        return self._num_checkpoints - self._num_pinned

    @property
    def num_available(self) -> int:
        """Slots `allocate_running` can hand out: free ones plus evictable checkpoints."""
        return len(self._free) + self._num_checkpoints - self._num_pinned

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free) - self._num_checkpoints

    def utility(self, value_tokens: int, evidence: int) -> float:
        """Compute saved per byte by a checkpoint worth `value_tokens` tokens, weighted by its evidence."""
        return value_tokens * self._value_per_token * (1 + evidence)

    # -- lookup ---------------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def checkpoint_keys(self, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` registered (block hash, position) pairs, the most recently registered last."""
        items = list(self._by_hash.items())
        if len(items) > limit:
            items = items[-limit:]
        return [(block_hash, self.slot_position[slot]) for block_hash, slot in items]

    def holds_any(self, block_hashes: Iterable[int]) -> bool:
        """Whether any of these hashes keys a checkpoint (one pass in C)."""
        return not self._by_hash.keys().isdisjoint(block_hashes)

    def is_evictable(self, slot: int) -> bool:
        return self.kind[slot] == SlotKind.CHECKPOINT and self.pins[slot] == 0

    # -- allocation -----------------------------------------------------------------------------
    def allocate_running(self) -> int | None:
        """A slot for a running request, evicting the lowest-priority checkpoint if none is free."""
        if not self._free and not self.num_evictable:
            return None
        slot = self.allocate_checkpoints([(None, math.inf, False)])[0]  # outranks every checkpoint
        if slot is not None:
            self.kind[slot] = SlotKind.RUNNING
        return slot

    def allocate_checkpoint(self, position: int, proven: bool = False, value_tokens: int | None = None) -> int | None:
        """A PENDING slot for a checkpoint after `position` tokens, or None if none is worth taking.

        `value_tokens`: tokens it saves beyond its writer's shallower checkpoint (default: all `position`).
        """
        value = position if value_tokens is None else value_tokens
        return self.allocate_checkpoints([(None, value, proven)])[0]

    def allocate_checkpoints(self, asks: Iterable[tuple[int | None, float, bool]]) -> list[int | None]:
        """PENDING slots for a chunk's checkpoints, asked as (block_hash, value_tokens, proven) in position order.

        None where the hash is registered already (nothing to write) or no slot is worth taking: with no
        free slot, the lowest-priority evictable checkpoint is displaced only if the new one would rank
        above it; otherwise the write is declined (and L rises to the new one's priority).
        """
        return [self._allocate(block_hash, value, proven) for block_hash, value, proven in asks]

    def _allocate(self, block_hash: int | None, value: float, proven: bool) -> int | None:
        if block_hash in self._by_hash:
            self.num_already_registered += 1
            return None
        if self._free:
            slot = self._free.pop()
        else:
            top = self._queue.top()
            if top is None:
                self.num_declined += 1
                return None
            top_priority, slot = top
            priority = self._queue.inflation + self.utility(value, proven)
            if priority < top_priority:
                self._queue.decline(priority)
                self.num_declined += 1
                return None
            self._queue.evict(slot, top_priority)
            if self.on_spill is not None:
                self.on_spill(slot, self.slot_hash[slot], self.slot_position[slot], False)
            self._unregister(slot, report=self.on_spill is None, discard=False)  # demoted: it may still hit
            self.num_evicted += 1
        self.kind[slot] = SlotKind.PENDING
        return slot

    def free(self, slot: int) -> None:
        """Return a RUNNING or PENDING slot."""
        assert self.kind[slot] in (SlotKind.RUNNING, SlotKind.PENDING), f"slot {slot} is {self.kind[slot]!r}"
        self.kind[slot] = SlotKind.FREE
        self._free.append(slot)

    # -- checkpoints ----------------------------------------------------------------------------
    def register(
        self, plans: Sequence[PlannedWrite], written: Sequence[CheckpointWrite], request_block_hashes: Sequence[int]
    ) -> list[bool]:
        """After a step: register each plan whose write the kernels reported; free every other planned slot.

        A plan registers its PENDING slot as the checkpoint after `write.position` tokens only if the report
        for its slot equals the plan, the position is a positive multiple of block_size, and `block_hash` is
        the request's hash at that position (provenance, DESIGN invariant 2); otherwise it is refused. A key
        already registered keeps its slot; the new one is freed. Reports nobody planned are refused.
        Returns, per plan, whether it was registered. One call per chunk, loop inlined (policy `all`).
        """
        reports = self._reports(plans, written)
        bs, by_hash, kind, num_hashes = self.block_size, self._by_hash, self.kind, len(request_block_hashes)
        slot_hash, slot_position, slot_value = self.slot_hash, self.slot_position, self.slot_value_tokens
        slot_proven, slot_hits, slot_source = self.slot_proven, self.slot_hits, self.slot_source
        pending, checkpoint = SlotKind.PENDING, SlotKind.CHECKPOINT
        per_token = self._value_per_token
        pushed: list[int] = []
        utilities: list[float] = []
        out: list[bool] = []
        for (planned, block_hash, _, proven, source, value), report in zip(plans, reports):
            position, slot = planned
            assert kind[slot] == pending, f"slot {slot} was not planned as a checkpoint"
            k = position // bs
            if (
                report != planned
                or position <= 0
                or position % bs
                or k > num_hashes
                or request_block_hashes[k - 1] != block_hash
            ):
                self.num_refused += report is not None  # None: planned but not written, never findable
                self.free(slot)
                out.append(False)
                continue
            if block_hash in by_hash:  # the registered one keeps its key
                self.num_duplicates += 1
                self.free(slot)
                out.append(False)
                continue
            if value <= 0 or value > position:
                value = position
            kind[slot] = checkpoint
            slot_hash[slot] = block_hash
            slot_position[slot] = position
            slot_value[slot] = value
            slot_proven[slot] = proven
            slot_hits[slot] = 0
            slot_source[slot] = source
            by_hash[block_hash] = slot
            pushed.append(slot)
            utilities.append(value * per_token * (1 + proven))  # utility(value, proven): no hits yet
            out.append(True)
        self._queue.push(pushed, utilities)  # L does not move while registering
        self._num_checkpoints += len(pushed)
        self.num_created += len(pushed)
        return out

    def _reports(
        self, plans: Sequence[PlannedWrite], written: Sequence[CheckpointWrite]
    ) -> Sequence[CheckpointWrite | None]:
        """Per plan, the write reported for its slot (None if none); reports nobody planned are refused."""
        if len(written) == len(plans) and all(map(eq, written, map(itemgetter(0), plans))):
            return written  # the usual report, the plan itself in order: no map by slot to build
        reported = {w.slot: w for w in written}
        self.num_refused += len(reported.keys() - {p.write.slot for p in plans})
        return [reported.get(p.write.slot) for p in plans]

    def touch(self, slot: int) -> None:
        """A hit used this checkpoint: refresh its priority (and only its)."""
        assert self.kind[slot] == SlotKind.CHECKPOINT
        if self.slot_hits[slot] == 0 and self.on_outcome is not None:
            self.on_outcome(self.slot_source[slot], True)
        self.slot_hits[slot] += 1
        self._push(slot)

    def _push(self, slot: int) -> None:
        evidence = self.slot_hits[slot] + self.slot_proven[slot]
        self._queue.push((slot,), (self.utility(self.slot_value_tokens[slot], evidence),))

    def priority(self, slot: int) -> float:
        """The current eviction priority of checkpoint `slot` (for tests and debugging)."""
        assert self.kind[slot] == SlotKind.CHECKPOINT
        return self._queue.priority(slot)

    @property
    def inflation(self) -> float:
        """GreedyDual's L: the priority of the last eviction or refusal."""
        return self._queue.inflation

    def _unregister(self, slot: int, report: bool = True, discard: bool = True) -> None:
        """Unmap checkpoint `slot` and make it FREE (`discard`: also take it out of the eviction order)."""
        block_hash = self.slot_hash[slot]
        assert block_hash is not None and self._by_hash.get(block_hash) == slot
        if report and self.slot_hits[slot] == 0 and self.on_outcome is not None:
            self.on_outcome(self.slot_source[slot], False)
        del self._by_hash[block_hash]
        self.slot_hash[slot] = None  # position, value and provenance are meaningful only while registered
        self._num_checkpoints -= 1
        if discard:
            self._queue.discard(slot)
        self.kind[slot] = SlotKind.FREE

    def _release(self, slot: int, report: bool = True) -> None:
        """Unregister checkpoint `slot` and make it free."""
        self._unregister(slot, report)
        self._free.append(slot)

    def drop(self, slot: int, block_hash: int) -> bool:
        """Unregister and free checkpoint `slot` if it still holds `block_hash`, is unpinned and unused."""
        if (
            self.kind[slot] != SlotKind.CHECKPOINT
            or self.slot_hash[slot] != block_hash
            or self.pins[slot]
            or self.slot_hits[slot]
        ):
            return False
        self._release(slot, report=False)  # superseded by a newer snapshot: not a verdict on the source
        return True

    def spill(self, slot: int) -> None:
        """Demote checkpoint `slot` to the lower tiers now and free it; no miss: it may hit from there."""
        self.on_spill(slot, self.slot_hash[slot], self.slot_position[slot], False)  # type: ignore[misc,arg-type]
        self._release(slot, report=False)

    def strand(self, block_hash: int) -> None:
        """The KV block `block_hash` names was evicted: a hybrid's checkpoint there can never hit again.

        Dropping it at once frees its slot for a checkpoint whose prefix is still in KV; keeping it
        would only pay if some request recomputed the whole prefix, and that request writes its own.
        """
        slot = self._by_hash.get(block_hash)
        if slot is None or self.pins[slot]:
            return
        # Not a verdict on the position (its KV left, not its use): counting it as a miss would make
        # the policy stop writing a source whenever KV is the tight budget, and a chain without a
        # checkpoint is the first KV to be evicted.
        if self.on_spill is not None:
            self.on_spill(slot, block_hash, self.slot_position[slot], True)
        self._release(slot, report=False)
        self.num_stranded += 1

    def pin(self, slot: int) -> None:
        assert self.kind[slot] == SlotKind.CHECKPOINT, f"pin of non-checkpoint slot {slot}"
        if self.pins[slot] == 0:
            self._num_pinned += 1
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0, f"unpin of unpinned slot {slot}"
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            self._num_pinned -= 1

    def reset(self) -> int:
        """Drop every unpinned checkpoint. Returns how many were dropped."""
        dropped = 0
        for slot in range(self.num_slots):
            if self.is_evictable(slot):
                self._release(slot)
                dropped += 1
        self._queue.compact()
        return dropped

    # -- integrity -------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert roles, map and counts agree. O(pool): for tests, not the hot path."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        counts = {kind: 0 for kind in SlotKind}
        for slot, kind in enumerate(self.kind):
            counts[kind] += 1
            assert (slot in free) == (kind == SlotKind.FREE), f"slot {slot} is {kind!r} but free={slot in free}"
            if kind == SlotKind.CHECKPOINT:
                block_hash = self.slot_hash[slot]
                assert block_hash is not None and self._by_hash.get(block_hash) == slot, f"slot {slot} unmapped"
                assert self.slot_position[slot] % self.block_size == 0 and self.slot_position[slot] > 0
            else:
                assert self.slot_hash[slot] is None, f"{kind!r} slot {slot} keeps a hash"
                assert self.pins[slot] == 0, f"{kind!r} slot {slot} is pinned (a pinned checkpoint was evicted)"
        assert counts[SlotKind.CHECKPOINT] == self._num_checkpoints == len(self._by_hash)
        self._queue.check({s for s, kind in enumerate(self.kind) if kind == SlotKind.CHECKPOINT})
        assert sum(1 for p in self.pins if p) == self._num_pinned
        assert counts[SlotKind.FREE] + self._num_checkpoints + self.num_in_use == self.num_slots
