"""The RG-LRU's diagonal linear recurrence (Griffin / RecurrentGemma, arXiv 2402.19427) over packed rows.

Glossary (code name: paper symbol)
- x [T, W]: the gated, normalized input sqrt(1 - a_t^2) (i_t * x_t) (W = lru_width channels; the layer
  prepares it, layers/rglru.py); a [T, W]: the decay a_t in [0, 1] (0 at a sequence start: a reset).
- h [W]: the state; state [S, W] holds one per slot, fp32.
- recurrence: h_t = a_t * h_{t-1} + x_t (in fp32); the output is h_t itself, in x's dtype.

Fast form (rglru_scan): every metadata chunk of the step at once, padded to the longest ([C, Q, W]; past a
chunk's end a = 1 and x = 0, so the last padded position holds the chunk's end state). A log-depth
(Hillis-Steele) scan from a zero state gives each position's local state l_t and the chunk's decay product
P_t = a_1 ... a_t: products of numbers in [0, 1], so nothing overflows whatever the decay (a cumulative-log
form would need range guards). The chunks' initial states are then carried along each row, one pass per
chunk index (vectorized over rows), and h_t = l_t + P_t h_0. Chunk ends are metadata chunk ends, so every
requested checkpoint position is written (DESIGN invariant 3). Decode batches take rglru_update (in place).
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import (
    chunk_view,
    copy_decode_checkpoints,
    decode_rows,
    pad_tokens,
    read_initial,
    record_decode_positions,
    write_ssm_states,
)


def _log_depth_scan(a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(l, P) over dim 1 of (c, q, w): l_t = a_t l_{t-1} + x_t from l_0 = 0, and P_t = a_1 ... a_t. Consumes a, x."""
    k, q = 1, a.shape[1]
    while k < q:
        x[:, k:] = torch.addcmul(x[:, k:], a[:, k:], x[:, :-k])  # right sides are read before the writes
        a[:, k:] = a[:, k:] * a[:, :-k]
        k *= 2
    return x, a


def _chunk_ranks(chunk_rows: list[int]) -> list[int]:
    """Each chunk's index among its row's chunks (a row's chunks are contiguous and in order)."""
    ranks = []
    for c, row in enumerate(chunk_rows):
        ranks.append(ranks[-1] + 1 if c and chunk_rows[c - 1] == row else 0)
    return ranks


def _chunk_initial_states(
    local_end: torch.Tensor, decay_end: torch.Tensor, h_rows: torch.Tensor, meta: SSMMetadata
) -> torch.Tensor:
    """[C, W] the state each chunk starts from: its row's initial state for a row's first chunk, else the end
    state of the chunk before it (local end + decay product x that chunk's initial state)."""
    ranks = _chunk_ranks(meta.chunk_seq_idx_list)
    h0 = h_rows[meta.chunk_seq_idx]  # right for every first chunk; later ones are filled in rank order
    dev = h0.device
    for rank in range(1, max(ranks, default=0) + 1):
        c = torch.tensor([i for i, r in enumerate(ranks) if r == rank], device=dev)
        h0[c] = torch.addcmul(local_end[c - 1], decay_end[c - 1], h0[c - 1])
    return h0


def rglru_scan(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [T, W] for packed rows; each row starts from its running slot (if it has context) or zeros, its
    state at every chunk end with a destination slot goes there, its final state to the running slot (decode
    batches included). Padding rows output zeros and touch no slot. Reference: rglru_scan_ref."""
    if meta.is_decode:
        h = rglru_update(x, a, state, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
                         meta.has_initial_state)  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return h
    t = x.shape[0]
    lens = meta.cu_chunk_seqlens.diff()
    idx, mask = chunk_view(meta.cu_chunk_seqlens, int(lens.max()))  # (c, q)
    keep = mask[..., None]
    xc = x.float()[idx].masked_fill_(~keep, 0.0)  # (c, q, w): no input past a chunk's end
    ac = a.float()[idx].masked_fill_(~keep, 1.0)  # and no decay: the last position holds the end state
    local, decay = _log_depth_scan(ac, xc)
    h_rows = read_initial(state, meta.state_indices, meta.has_initial_state)  # (b, w); pad rows: zeros
    h0 = _chunk_initial_states(local[:, -1], decay[:, -1], h_rows, meta)  # (c, w)
    hs = local.addcmul_(decay, h0[:, None, :])  # (c, q, w)
    write_ssm_states(state, hs[:, -1], meta, slot_positions)
    out = torch.empty(t, x.shape[1], dtype=torch.float32, device=x.device)
    out[idx[mask]] = hs[mask]
    if PAD_SLOT_ID in meta.state_indices_list:
        out.masked_fill_(pad_tokens(meta, t)[:, None], 0.0)
    return out.to(x.dtype)


def rglru_update(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: h = a h + x in state[slot], in place (an fp32 cache); PAD rows output zeros.

    positions ([B], the token's absolute position) is required with slot_positions, which records positions + 1
    for every slot written. has_initial_state ([B] bool, optional): rows marked False start from zeros.
    Running slots must be distinct. Reference: rglru_update_ref."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf, af = x.float(), a.float()
    for r, slot, init in decode_rows(state_indices, has_initial_state):
        h = state[slot]
        if init:
            h.mul_(af[r]).add_(xf[r])
        else:
            h.copy_(xf[r])
        out[r] = h
    record_decode_positions(slot_positions, state_indices, positions)
    return out.to(x.dtype)


def rglru_update_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of rglru_update (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        init = has_initial_state is None or bool(has_initial_state[row])
        h_prev = state[slot].float() if init else torch.zeros(x.shape[1], device=x.device)
        h = a[row].float() * h_prev + x[row].float()
        state[slot] = h.to(state.dtype)
        out[row] = h
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
    return out.to(x.dtype)


def rglru_scan_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of rglru_scan (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        h = state[slot].float() if meta.has_initial_state_list[row] else torch.zeros(x.shape[1], device=x.device)
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            h = a[tok].float() * h + x[tok].float()
            out[tok] = h
            c = chunk_end.get(tok + 1)
            if c is not None and meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                state[meta.chunk_dest_slots_list[c]] = h.to(state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        state[slot] = h.to(state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = meta.chunk_end_positions_list[meta.last_chunk_indices[row]]
    return out.to(x.dtype)
