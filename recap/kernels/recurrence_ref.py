"""The plain references of a per-token recurrence's scan (packed prefill) and decode update.

A state kind whose step is h_t = f(h_{t-1}, token t) (RG-LRU, RWKV's WKV, ...) writes its kernels' references
as one `Step` and the start state; these drivers hold what every such reference shares: which rows run, where
each starts (its slot or the empty state), the checkpoint written at every chunk end (a block boundary inside a
prefill, so a later hit can start there), the running slot and `slot_positions` last. The fast kernels beside
them are compared against these on random packed batches (tests/kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata

# (state in fp32, token index into the packed inputs) -> (the token's output row, the next state in fp32)
Step = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
Empty = Callable[[], torch.Tensor]  # the state a sequence starts from, fp32


def scan_ref(
    step: Step, empty: Empty, out: torch.Tensor, state: torch.Tensor, meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Run `step` token by token over each valid row of a packed prefill into `out` [T, ...]: from its slot
    (has_initial_state) or `empty()`, the state at every chunk end into that chunk's destination slot, the last
    into the running slot; `slot_positions` records each written slot's position."""
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    dest, ends = meta.chunk_dest_slots_list, meta.chunk_end_positions_list
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        h = state[slot].float() if meta.has_initial_state_list[row] else empty()
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            out[tok], h = step(h, tok)
            c = chunk_end.get(tok + 1)
            if c is not None and dest[c] != PAD_SLOT_ID:
                state[dest[c]] = h.to(state.dtype)
                if slot_positions is not None:
                    slot_positions[dest[c]] = ends[c]
        state[slot] = h.to(state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = ends[meta.last_chunk_indices[row]]


def update_ref(
    step: Step, empty: Empty, out: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One decode token per row: `step` from the row's slot (or `empty()` where has_initial_state says so) into
    `out` [B, ...] and the slot; pad rows are skipped; slot_positions[slot] = positions[row] + 1."""
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        init = has_initial_state is None or bool(has_initial_state[row])
        out[row], h = step(state[slot].float() if init else empty(), row)
        state[slot] = h.to(state.dtype)
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
