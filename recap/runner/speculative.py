"""Verifying a speculative step in the runner (docs/speculative.md): which slots hold the state after each
position of a verify row, greedy acceptance, and restoring the state after the accepted tokens.

A verify row feeds [decode token, d1..dk] at positions N-1..N-1+k. The kernels write the state after every
position but the last into a slot, through the same "state after exactly p tokens into slot s" contract as
block-boundary checkpoints (SeqSpec.checkpoints, DESIGN invariant 3); the running slot ends after all k + 1. When
a < k drafts are accepted, the state after N + a tokens (conv window and SSM/matrix state of every recurrent
layer: the whole slot) is copied into the running slot, its position checked as a checkpoint's is. The slots are
scratch slots past the core's pool (the core never sees them), or a checkpoint slot the core planned at the
same position (the state after N tokens at a block boundary).

Acceptance: a greedy row accepts the longest prefix of drafts equal to the argmax; a sampled row verifies by
rejection sampling (runner/rejection.py), so its tokens have the unspeculated sampler's law. Either way position j
is processed as the plain sampler would process it there: penalties see the accepted drafts before j as generated
tokens, and min_tokens bans count them (`position_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from recap.core.output import ScheduledRequest
from recap.runner.rejection import point_mass_emit
from recap.runner.sampler import SampleRow, draw, position_generator, processed_logits, target_probs


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


def position_rows(row: SampleRow, drafts: Sequence[int], num_output: int, stop_ids: Sequence[int]) -> list[SampleRow]:
    """The sampler's view of each position j = 0..k of a verify row whose request had generated num_output tokens
    (row: its view at j = 0): the drafts before j count as generated, for the penalties and the min_tokens ban of
    stop_ids (EOS and stop tokens)."""
    if row.allowed is not None:
        raise ValueError("a structured-output request cannot speculate (its grammar would need the drafts)")
    min_tokens = row.params.min_tokens
    seed = row.params.seed if row.generator is not None else None  # each position draws from its own generator
    return [
        SampleRow(row.params, row.generator if seed is None else position_generator(seed, num_output + j),
                  tuple(stop_ids) if num_output + j < min_tokens else (), row.prompt_token_ids,
                  [*row.output_token_ids, *drafts[:j]])
        for j in range(len(drafts) + 1)
    ]  # fmt: skip


def verify_emit(logits: torch.Tensor, drafts: Sequence[int], rows: Sequence[SampleRow],
                shared: torch.Generator | None) -> list[int]:  # fmt: skip
    """The tokens one verify row emits from its logits at positions 0..k ([k + 1, V]) and its position_rows:
    greedy acceptance, or rejection sampling of the point-mass drafts with the request's generator (else shared).
    Each position's logits are processed only if verification reaches it."""
    if logits.shape[0] != len(drafts) + 1 or len(rows) != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows, {len(rows)} sample rows for {len(drafts)} drafts")
    params = rows[0].params
    if params.greedy:
        emitted = []
        for j in range(len(drafts) + 1):
            emitted.append(int(torch.argmax(processed_logits(logits[j], rows[j]))))
            if j == len(drafts) or emitted[j] != drafts[j]:
                break
        return emitted
    gens = [row.generator if row.generator is not None else shared for row in rows]
    return point_mass_emit(lambda j: target_probs(processed_logits(logits[j], rows[j]), params), drafts, gens, draw)
