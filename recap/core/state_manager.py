"""The state cache group's manager: running slots, planned checkpoint writes and their registration."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, islice, repeat
from operator import is_not

from recap.core.output import PAD_SLOT_ID, CheckpointWrite, new_tuple
from recap.core.policy import Position, Source
from recap.core.request import Request
from recap.core.state_pool import PlannedWrite, StatePool


class StateManager:
    """Running slot per request, plus the checkpoints its steps write.

    Side effects: `admit` pins the hit checkpoint and takes a running slot (may evict a checkpoint);
    `plan` takes PENDING slots (may evict checkpoints); `commit` registers written checkpoints and frees
    unwritten ones; `free` returns the running slot and any PENDING slots.
    """

    def __init__(self, pool: StatePool, block_size: int, enable_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching  # False: the state group never hits (policy none)
        self.running: dict[str, int] = {}
        self.pending: dict[str, list[PlannedWrite]] = {}
        self._provisional: dict[str, tuple[int, int]] = {}  # request -> (slot, hash) of its last snapshot
        self._base: dict[str, int] = {}  # request -> position of its deepest checkpoint so far (hit or own)
        self._hit: dict[str, int] = {}  # request -> position of the checkpoint it hit (0: none)
        self.num_planned = 0
        # Sources whose checkpoints go straight to the lower tiers once registered (the tiers set it): speculative
        # positions the tiers budget for (the policy's tail ladder), which would crowd the read pool.
        self.write_through: frozenset[int] = frozenset()
        self.num_written_through = 0

    def find_checkpoint(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(k, slot) of the deepest checkpoint after k <= max_blocks blocks of this chain; (0, PAD)."""
        if not self.enable_caching:
            return 0, PAD_SLOT_ID
        num_blocks = min(max_blocks, len(block_hashes))
        if num_blocks <= 0 or not self.pool.holds_any(islice(block_hashes, num_blocks)):  # the usual miss: no loop
            return 0, PAD_SLOT_ID
        lookup = self.pool.lookup
        for k in range(num_blocks, 0, -1):
            slot = lookup(block_hashes[k - 1])
            if slot is not None:
                return k, slot
        return 0, PAD_SLOT_ID

    def can_admit(self, hit_slot: int) -> bool:
        """Whether a running slot can be had without evicting the checkpoint this request hits."""
        reserved = 1 if hit_slot != PAD_SLOT_ID and self.pool.is_evictable(hit_slot) else 0
        return self.pool.num_available - reserved >= 1

    def admit(self, request_id: str, hit_slot: int) -> tuple[int, int] | None:
        """Take a running slot; on a hit, pin the checkpoint and return the (src, dst) copy to perform."""
        assert request_id not in self.running, f"{request_id} already holds a running slot"
        self._base[request_id] = self._hit[request_id] = 0
        if hit_slot != PAD_SLOT_ID:
            self.pool.pin(hit_slot)  # before allocating: the allocation must not evict it
            self.pool.touch(hit_slot)
            self._base[request_id] = self._hit[request_id] = self.pool.slot_position[hit_slot]
        slot = self.pool.allocate_running()
        assert slot is not None, "admit without can_admit"
        self.running[request_id] = slot
        return None if hit_slot == PAD_SLOT_ID else (hit_slot, slot)

    def plan(
        self, request_id: str, block_hashes: Sequence[int], positions: Sequence[Position]
    ) -> list[CheckpointWrite]:
        """Fresh PENDING slots for a chunk's checkpoint positions (sorted); skipped where registered or no slot.

        A write's eviction value counts the tokens past the request's deepest checkpoint so far (the one it
        hit or its own previous one): what holding it saves over what the chain already has. A tail ladder
        rung (Source.LADDER) counts from the hit and is no base for later positions: a sharer diverging
        below the tail finds the rung and not the tail, so the tail keeps the value it had alone, and a
        rung past the tail is worth what it saves a sharer that has only the hit.
        One call per chunk: under policy `all` a replay plans millions of writes.
        """
        bs = self.block_size
        base = self._base.get(request_id, 0)
        hit = self._hit.get(request_id, 0)
        asks = []
        for position, provisional, proven, source in positions:
            below = hit if source == Source.LADDER else base
            asks.append((block_hashes[position // bs - 1], position - below if position - below > bs else bs, proven))
            if not provisional and position > base and source != Source.LADDER:  # a snapshot is superseded
                base = position
        self._base[request_id] = base
        out: list[CheckpointWrite] = []
        plans = self.pending.get(request_id, [])
        for slot, (block_hash, value, proven), (position, provisional, _, source) in zip(
            self.pool.allocate_checkpoints(asks), asks, positions
        ):
            if slot is not None:
                write = new_tuple(CheckpointWrite, (position, slot))
                out.append(write)
                plans.append(new_tuple(PlannedWrite, (write, block_hash, provisional, proven, source, value)))
        if plans:  # no entry for a request with nothing pending
            self.pending[request_id] = plans
        self.num_planned += len(out)
        return out

    def plan_every_block(
        self, request_id: str, block_hashes: Sequence[int], boundaries: range
    ) -> list[CheckpointWrite]:
        """`plan` of a plain checkpoint (Source.EVERY_BLOCK) at each of these boundaries (policy `all`).

        The same writes, pool and plans as `plan` of one Position per boundary, without building them: a
        trace replay plans millions. Past the first boundary, the previous one (or a deeper checkpoint) is the
        base, so each later write is worth one block.
        """
        if not boundaries:
            return []
        bs = self.block_size
        base = self._base.get(request_id, 0)
        values = [max(boundaries[0] - base, bs)] + [bs] * (len(boundaries) - 1)
        self._base[request_id] = max(base, boundaries[-1])
        hashes = block_hashes[boundaries[0] // bs - 1 : boundaries[-1] // bs]
        assert len(hashes) == len(boundaries), f"{request_id}: boundaries past its block hashes"
        slots: Sequence[int | None] = self.pool.allocate_checkpoints(zip(hashes, values, repeat(False)))
        positions: Iterable[int] = boundaries
        if None in slots:  # registered already, or declined: plan the others
            kept = list(map(is_not, slots, repeat(None)))
            positions, slots, hashes, values = (list(compress(xs, kept)) for xs in (boundaries, slots, hashes, values))
        # A write and a plan per position, built in C
        out = list(map(new_tuple, repeat(CheckpointWrite), zip(positions, slots)))
        no, source = repeat(False), repeat(Source.EVERY_BLOCK)
        plans = self.pending.get(request_id, [])
        plans.extend(map(new_tuple, repeat(PlannedWrite), zip(out, hashes, no, no, source, values)))
        if plans:  # no entry for a request with nothing pending
            self.pending[request_id] = plans
        self.num_planned += len(out)
        return out

    def commit(self, request: Request, written: Sequence[CheckpointWrite], upto: int | None = None) -> int:
        """Register the reported writes that match the plan; free every other planned slot. `upto`: only the plans
        at or before this position (the step just completed); later ones (a step in flight) stay pending.

        Returns the number registered.
        """
        plans = self.pending.pop(request.request_id, None)
        if plans and upto is not None and plans[-1].write.position > upto:  # a step scheduled ahead (async) planned
            later = [p for p in plans if p.write.position > upto]
            plans = plans[: len(plans) - len(later)]
            assert all(p.write.position <= upto for p in plans), f"{request.request_id}: plans out of order"
            self.pending[request.request_id] = later
        if not plans:
            self.pool.num_refused += len(written)  # writes nobody planned: never registered
            return 0
        registered = self.pool.register(plans, written, request.block_hashes)
        if self.write_through and self.pool.on_spill is not None:
            for plan, ok in zip(plans, registered):
                if ok and plan.source in self.write_through:
                    self.pool.spill(plan.write.slot)
                    self.num_written_through += 1
        prompt_len = request.num_prompt_tokens
        if plans[-1].write.position >= prompt_len:  # sorted, and snapshots lie past the prompt
            for plan, ok in zip(plans, registered):
                if plan.provisional or plan.write.position >= prompt_len:
                    self._supersede(request.request_id, plan, ok)
        return sum(registered)

    def _supersede(self, request_id: str, plan: PlannedWrite, registered: bool) -> None:
        """A newer decode-region checkpoint exists: drop the request's previous snapshot."""
        previous = self._provisional.pop(request_id, None)
        if previous is not None:
            self.pool.drop(*previous)
        if registered and plan.provisional:
            self._provisional[request_id] = (plan.write.slot, plan.block_hash)

    def free(self, request_id: str) -> None:
        """Return the running slot and PENDING slots; registered checkpoints stay findable."""
        slot = self.running.pop(request_id, None)
        if slot is not None:
            self.pool.free(slot)
        for plan in self.pending.pop(request_id, ()):
            self.pool.free(plan.write.slot)
        self._provisional.pop(request_id, None)
        self._base.pop(request_id, None)
        self._hit.pop(request_id, None)

    def forget_provisional(self) -> None:
        self._provisional.clear()
