"""Index helpers shared by the varlen kernels: token rows, padded chunk views, slot reads and writes.

Glossary
- T tokens, B rows, C chunks, S slots, Q the padded chunk length (longest chunk of the step).
- valid row: a row whose running slot is not PAD_SLOT_ID. Kernels never read or write a slot for other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata


def token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64: the row of every token of the packed batch."""
    counts = query_start_loc.diff()
    rows = torch.arange(counts.numel(), device=query_start_loc.device)
    return torch.repeat_interleave(rows, counts, output_size=num_tokens)


def chunk_view(cu_chunk_seqlens: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index [C, q] (token of each chunk position, 0 past the chunk end) and its mask [C, q]."""
    starts = cu_chunk_seqlens[:-1]
    lens = cu_chunk_seqlens.diff()
    ar = torch.arange(q, device=starts.device)
    mask = ar < lens[:, None]
    idx = (starts[:, None] + ar).masked_fill(~mask, 0)
    return idx, mask


def process_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The step size Delta in fp32: softplus(dt + dt_bias), then clamped to `limit` (the Mamba2 dt_limit)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if limit != (0.0, float("inf")):
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def read_initial(cache: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor) -> torch.Tensor:
    """fp32 [B, ...] initial states: the slot content where the row has one, zeros otherwise (pad rows too)."""
    out = torch.zeros((slots.numel(), *cache.shape[1:]), dtype=torch.float32, device=cache.device)
    use = (slots != PAD_SLOT_ID) & has_initial.to(torch.bool)
    if bool(use.any()):
        out[use] = cache[slots[use]].float()
    return out


def write_slots(
    cache: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """cache[slots[i]] = states[i] for every slot that is not PAD_SLOT_ID; record positions if asked.

    One index_copy_; rows are picked with index_select only when some slot is a pad (boolean-mask indexing
    of large rows is several times slower on CPU).
    """
    if slot_positions is not None and positions is None:
        raise ValueError("slot_positions needs positions")
    keep = slots != PAD_SLOT_ID
    if not bool(keep.all()):
        if not bool(keep.any()):
            return
        rows = keep.nonzero().squeeze(1)
        slots, states = slots.index_select(0, rows), states.index_select(0, rows)
        positions = None if positions is None else positions.index_select(0, rows)
    cache.index_copy_(0, slots, states.to(cache.dtype))
    if slot_positions is not None and positions is not None:
        slot_positions.index_copy_(0, slots, positions.to(slot_positions.dtype))


def write_ssm_states(
    cache: torch.Tensor,
    chunk_end_states: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None,
) -> None:
    """Checkpoint every chunk end that has a destination slot, then each row's final state to its running slot."""
    write_slots(cache, meta.chunk_dest_slots, chunk_end_states, slot_positions, meta.chunk_end_positions)
    last = meta.last_chunk_indices
    write_slots(cache, meta.state_indices, chunk_end_states[last], slot_positions, meta.chunk_end_positions[last])


def copy_rows_to_slots(
    cache: torch.Tensor,
    states: torch.Tensor,
    writes: list[tuple[int, int, int]],
    slot_positions: torch.Tensor | None,
) -> None:
    """cache[slot] = states[row] for every (row, slot, position) in writes (Python values), via write_slots.

    states is read in place when writes take its rows in order, else through one index_select.
    """
    if not writes:
        return
    rows, slots, positions = (list(v) for v in zip(*writes))
    dev = cache.device
    src = states if rows == list(range(states.shape[0])) else states.index_select(0, torch.tensor(rows, device=dev))
    write_slots(cache, torch.tensor(slots, device=dev), src, slot_positions, torch.tensor(positions, device=dev))


def decode_rows(state_indices: torch.Tensor, has_initial_state: torch.Tensor | None) -> list[tuple[int, int, bool]]:
    """(row, slot, has initial state) of every valid row of a one-token-per-row step, as Python values."""
    slots = state_indices.tolist()
    init = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    return [(r, s, bool(i)) for r, (s, i) in enumerate(zip(slots, init)) if s != PAD_SLOT_ID]


def record_decode_positions(
    slot_positions: torch.Tensor | None, state_indices: torch.Tensor, positions: torch.Tensor | None
) -> None:
    """slot_positions[slot] = positions + 1 for every valid row (a decode step folds one token per row)."""
    if slot_positions is None:
        return
    if positions is None:
        raise ValueError("slot_positions needs positions")
    if state_indices.numel() == 0:
        return
    # Without reading the device from the host (a CUDA graph replays this): a padding row writes the first real
    # row's slot with that row's value (duplicates of one value are harmless), or slot 0's own value when every
    # row is padding.
    # The first real row j is picked by index_select: indexing with a 0-dim tensor (t[j]) reads j on the host.
    keep = state_indices != PAD_SLOT_ID
    j = torch.argmax(keep.to(torch.int8)).view(1)
    keep_j = keep.index_select(0, j)
    first = torch.where(keep_j, state_indices.index_select(0, j), 0)
    first_value = torch.where(keep_j, positions.index_select(0, j) + 1,
                              slot_positions.index_select(0, first).to(positions.dtype))  # fmt: skip
    index = torch.where(keep, state_indices, first)
    slot_positions.index_copy_(0, index, torch.where(keep, positions + 1, first_value).to(slot_positions.dtype))


def copy_decode_checkpoints(cache: torch.Tensor, meta: SSMMetadata, slot_positions: torch.Tensor | None) -> None:
    """In a decode batch (one chunk per row), copy each row's new running state to its checkpoint slot."""
    if all(d == PAD_SLOT_ID for d in meta.chunk_dest_slots_list):  # no checkpoint this step (the usual case)
        return
    keep = (meta.chunk_dest_slots != PAD_SLOT_ID) & (meta.state_indices != PAD_SLOT_ID)
    if not bool(keep.any()):
        return
    write_slots(
        cache, meta.chunk_dest_slots[keep], cache[meta.state_indices[keep]], slot_positions,
        meta.chunk_end_positions[keep],
    )  # fmt: skip


def pad_tokens(meta: SSMMetadata, num_tokens: int) -> torch.Tensor:
    """[T] bool: tokens of padding rows (running slot PAD_SLOT_ID)."""
    pad_rows = meta.state_indices == PAD_SLOT_ID
    return torch.repeat_interleave(pad_rows, meta.query_start_loc.diff(), output_size=num_tokens)


def zero_pad_tokens(out: torch.Tensor, meta: SSMMetadata) -> None:
    """Zero, in place, the rows of out [T, ...] that belong to padding rows (a scan's PAD rows output zeros)."""
    if PAD_SLOT_ID in meta.state_indices_list:
        mask = pad_tokens(meta, out.shape[0])
        out.masked_fill_(mask.view(-1, *([1] * (out.dim() - 1))), 0.0)
