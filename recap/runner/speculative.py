"""Verifying a speculative step in the runner (docs/speculative.md): which slots hold the state after each
position of a verify row, greedy acceptance, and restoring the state after the accepted tokens.

A verify row feeds [decode token, d1..dk] at positions N-1..N-1+k. The kernels write the state after every
position but the last into a slot, through the same "state after exactly p tokens into slot s" contract as
block-boundary checkpoints (SeqSpec.checkpoints, DESIGN invariant 3); the running slot ends after all k + 1. When
a < k drafts are accepted, the state after N + a tokens (conv window and SSM/matrix state of every recurrent
layer: the whole slot) is copied into the running slot, its position checked as a checkpoint's is. The slots are
scratch slots past the core's pool (the core never sees them), or a checkpoint slot the core planned at the
same position (the state after N tokens at a block boundary).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from recap.core.output import ScheduledRequest


@dataclass(frozen=True)
class VerifyRow:
    """One request's verify step, in plain integers."""

    row: int  # its row in the step
    request_id: str
    first: int  # N: tokens folded in after the row's decode token
    drafts: list[int]
    # The slot holding the state after first + j tokens, j = 0..k-1 ([] for a model without recurrent layers).
    state_slots: list[int]
    running_slot: int

    def extra_writes(self, planned: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The row's (position, slot) state writes: the planned checkpoints and the per-position slots."""
        writes = dict(planned)
        writes.update((self.first + j, slot) for j, slot in enumerate(self.state_slots))
        return sorted(writes.items())


def verify_rows(scheduled: Sequence[ScheduledRequest], scratch: Iterator[int], with_state: bool) -> list[VerifyRow]:
    """The step's verify rows; each takes from `scratch` a slot per draft position the core planned no checkpoint
    at. Raises RuntimeError when scratch runs out (more drafting rows than it was sized for)."""
    rows = []
    for row, s in enumerate(scheduled):
        k = s.num_draft_tokens
        if not k:
            continue
        first = s.num_computed_tokens + len(s.token_ids) - k
        planned = {c.position: c.slot for c in s.checkpoints}
        slots = []
        if with_state:
            for p in range(first, first + k):
                slot = planned.get(p)
                if slot is None:
                    slot = next(scratch, None)
                    if slot is None:
                        raise RuntimeError("speculation: more drafting rows than scratch state slots")
                slots.append(slot)
        rows.append(VerifyRow(row, s.request_id, first, list(s.token_ids[len(s.token_ids) - k :]), slots,
                              s.state_slot))  # fmt: skip
    return rows


def accepted_length(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Greedy verification: the longest prefix of drafts equal to the target's argmax at each position
    (targets[j] is the target's token after the decode token and d1..dj)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def greedy_emit(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy verify step emits: the accepted drafts, then the target's token after them."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(targets)} target tokens for {len(drafts)} drafts (need one more)")
    a = accepted_length(drafts, targets)
    return [*drafts[:a], targets[a]]
