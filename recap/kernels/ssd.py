"""Mamba2 SSD (arXiv 2405.21060, section 6: the chunked "state space dual" algorithm) over packed rows.

Glossary (code name: paper symbol)
- x [T, H, P]: X, H heads of head dim P; dt [T, H]: Delta (after bias, softplus, clamp to dt_limit).
- A [H]: the scalar a per head (negative); dA = Delta * A: log of the per-token decay.
- B, C [T, G, N]: B_t, C_t per group; head h reads group h // (H // G). D [H]: the skip.
- h [.., H, P, N]: the state; ssm_state [S, H, P, N] holds one per slot.
- recurrence: h_t = exp(dA_t) h_{t-1} + Delta_t x_t B_t^T;  y_t = h_t C_t + D x_t.
- chunk: a run of one row's tokens inside one metadata chunk, at most SUB_CHUNK long; padded here to Q,
  the longest chunk of the step.
- segsum[i, j] = dA_{j+1} + .. + dA_i (i >= j), -inf above the diagonal; L = exp(segsum).

Algorithm (section 6, numbered as in the paper's listing):
1. intra-chunk outputs (diagonal blocks): Y_diag = (C B^T * L) (Delta x), a masked attention per chunk.
2. chunk states: the state each chunk adds, decayed to the chunk end (right factor of the low-rank blocks).
3. inter-chunk recurrence: h_start[k+1] = exp(sum of dA over chunk k) h_start[k] + states[k], per row,
   starting from the slot state; a loop over chunk index, vectorized across rows.
4. state -> output (left factor): Y_off = exp(cumsum dA) * (C h_start).
Padded positions get Delta = 0 (decay 1, no input), so every chunk's end state is exact.
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import (
    chunk_view,
    copy_decode_checkpoints,
    pad_tokens,
    process_dt,
    read_initial,
    write_slots,
    write_ssm_states,
)

NO_LIMIT = (0.0, float("inf"))
# Metadata chunks are cut further into runs of at most SUB_CHUNK tokens (the math is the same at any
# cut): the quadratic intra-chunk part costs O(Q) per token, the state passing O(P N / Q) per token.
SUB_CHUNK = 64


def _sub_chunks(meta: SSMMetadata, sub: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut every metadata chunk into runs of <= sub tokens.

    Returns the runs' token offsets [R+1], each row's first run and run count [B], and the run that ends
    each metadata chunk [C]. A row's runs are contiguous and in order.
    """
    cu = meta.cu_chunk_seqlens_list
    bounds = [0]
    ends: list[int] = []
    first = [0] * len(meta.state_indices_list)
    counts = [0] * len(meta.state_indices_list)
    for c, row in enumerate(meta.chunk_seq_idx_list):
        if counts[row] == 0:
            first[row] = len(bounds) - 1
        cuts = list(range(cu[c] + sub, cu[c + 1], sub)) + [cu[c + 1]]
        bounds.extend(cuts)
        counts[row] += len(cuts)
        ends.append(len(bounds) - 2)
    dev = meta.cu_chunk_seqlens.device

    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=dev)

    return t(bounds), t(first), t(counts), t(ends)


def segsum(x: torch.Tensor) -> torch.Tensor:
    """(..., q) -> (..., q, q): sum_{k=j+1..i} x_k below the diagonal, -inf above.

    Summed directly (a masked cumsum), not as a difference of cumsums, which would cancel badly.
    """
    q = x.shape[-1]
    strict = torch.ones(q, q, dtype=torch.bool, device=x.device).tril(-1)
    xe = x[..., None, :].expand(*x.shape, q).transpose(-1, -2)  # [..., i, j] = x_i
    seg = xe.masked_fill(~strict, 0.0).cumsum(-2)
    return seg.masked_fill(~strict.logical_or(torch.eye(q, dtype=torch.bool, device=x.device)), -torch.inf)


def _d_skip(D: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | float:
    """D x for x (..., H, P); D is [H] (or [H, P])."""
    if D is None:
        return 0.0
    return x * D.float().reshape(D.shape[0], -1)


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    sub_chunk: int = SUB_CHUNK,
) -> torch.Tensor:
    """Chunked SSD of every row from its slot state; writes running and checkpoint slots. PAD rows: zeros."""
    if meta.is_decode:
        y = ssd_state_update(
            ssm_state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, meta.state_indices,
            slot_positions, meta.chunk_end_positions - 1, meta.has_initial_state,
        )  # fmt: skip
        copy_decode_checkpoints(ssm_state, meta, slot_positions)
        return y
    t, nh, p = x.shape
    g, n = B.shape[1:]
    rep = nh // g
    cu, first, counts, meta_ends = _sub_chunks(meta, sub_chunk)
    q = int(cu.diff().max())
    idx, mask = chunk_view(cu, q)  # (c, q)
    nc = idx.shape[0]
    delta = process_dt(dt, dt_bias, dt_softplus, dt_limit)[idx] * mask[..., None]  # (c, q, h)
    xf = x.float()
    bc = B.float()[idx]  # (c, q, g, n)
    cc = C.float()[idx]  # (c, q, g, n)
    dA = (delta * A.float()).transpose(1, 2)  # (c, h, q)
    dx = (xf[idx] * delta[..., None]).permute(0, 2, 1, 3)  # (c, h, q, p): Delta_j x_j

    # 1. intra-chunk: Y_diag[i] = sum_j (C_i . B_j) L[i, j] Delta_j x_j
    L = torch.exp(segsum(dA))  # (c, h, q, q)
    decay_to_end = L[:, :, -1, :].clone()  # (c, h, q): exp(dA_{j+1} + .. + dA_end)
    scores = L.view(nc, g, rep, q, q).mul_(torch.einsum("cign,cjgn->cgij", cc, bc)[:, :, None])  # (c, g, r, q, q)
    y = torch.matmul(scores.view(nc, nh, q, q), dx)  # (c, h, q, p)

    # 2. chunk states: sum_j exp(dA_{j+1} + .. + dA_end) Delta_j x_j B_j^T
    wx = (dx * decay_to_end[..., None]).view(nc, g, rep, q, p)  # (c, g, r, q, p)
    states = torch.einsum("cgrqp,cqgn->cgrpn", wx, bc).reshape(nc, nh, p, n)  # (c, h, p, n)

    # 3. inter-chunk recurrence, from each row's slot state
    chunk_decay = torch.exp(dA.sum(-1))[..., None, None]  # (c, h, 1, 1)
    h0 = read_initial(ssm_state, meta.state_indices, meta.has_initial_state)  # (b, h, p, n)
    h_start = _pass_states(h0, chunk_decay, states, first, counts)  # (c, h, p, n)
    h_end = torch.addcmul(states[meta_ends], chunk_decay[meta_ends], h_start[meta_ends])  # (C, h, p, n)
    write_ssm_states(ssm_state, h_end, meta, slot_positions)

    # 4. state -> output: Y_off[i] = exp(dA_1 + .. + dA_i) C_i . h_start
    ch = torch.einsum("cqgn,cgrpn->cgrqp", cc, h_start.view(nc, g, rep, p, n)).reshape(nc, nh, q, p)
    y.addcmul_(ch, torch.exp(dA.cumsum(-1))[..., None])
    out = torch.empty(t, nh, p, dtype=torch.float32, device=x.device)
    out[idx[mask]] = y.transpose(1, 2)[mask]  # (c, q, h, p) -> (t, h, p)
    if D is not None:
        out += _d_skip(D, xf)
    return out.masked_fill_(pad_tokens(meta, t)[:, None, None], 0.0).to(x.dtype)


def _pass_states(
    h: torch.Tensor, chunk_decay: torch.Tensor, states: torch.Tensor, first: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """State at the start of every chunk: h_start[k+1] = decay[k] h_start[k] + states[k] within each row.

    h: (b, h, p, n) initial states (updated in place); one chunk index at a time, vectorized across rows.
    """
    h_start = torch.empty_like(states)
    first_l, counts_l = first.tolist(), counts.tolist()
    for k in range(max(counts_l)):
        rows = [r for r, cnt in enumerate(counts_l) if cnt > k]
        if len(rows) == 1:  # one row left (long prefill): views, in place
            c, hr = first_l[rows[0]] + k, h[rows[0]]
            h_start[c] = hr
            hr.mul_(chunk_decay[c]).add_(states[c])
            continue
        rows_t = torch.tensor(rows, device=h.device)
        cid = first[rows_t] + k
        h_start[cid] = h[rows_t]
        h[rows_t] = torch.addcmul(states[cid], chunk_decay[cid], h[rows_t])
    return h_start


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: h = exp(dA) h + Delta x B^T in state[slot]; y = h C + D x. PAD rows: zeros.

    positions ([B], the token's absolute position as in ForwardBatch.positions) is required with
    slot_positions, which records positions + 1 (tokens folded into the state) for every slot written.
    has_initial_state (optional [B] bool): rows marked False start from a zero state instead of the slot.
    """
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    valid = state_indices != PAD_SLOT_ID
    if not bool(valid.any()):
        return out
    slots = state_indices[valid]
    init = torch.ones_like(slots, dtype=torch.bool) if has_initial_state is None else has_initial_state[valid]
    h = read_initial(state, slots, init)  # (b, h, p, n)
    b, nh, p, n = h.shape
    g = B.shape[1]
    d = process_dt(dt[valid], dt_bias, dt_softplus, dt_limit)  # (b, h)
    xv = x[valid].float()
    bh = B[valid].float().repeat_interleave(nh // g, dim=1)  # (b, h, n)
    chh = C[valid].float().repeat_interleave(nh // g, dim=1)  # (b, h, n)
    h = torch.exp(d * A.float())[..., None, None] * h + (xv * d[..., None])[..., None] * bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", h, chh) + _d_skip(D, xv)
    out[valid] = y.to(x.dtype)
    write_slots(state, slots, h, slot_positions, None if positions is None else positions[valid] + 1)
    return out


def ssd_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of ssd_varlen (same signature and side effects)."""
    t, nh, p = x.shape
    rep = nh // B.shape[1]
    delta = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (t, h)
    Af = A.float()
    y = torch.zeros(t, nh, p, dtype=torch.float32, device=x.device)
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        h = torch.zeros(ssm_state.shape[1:], device=x.device)
        if meta.has_initial_state_list[row]:
            h = ssm_state[slot].float()
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            bt = B[tok].float().repeat_interleave(rep, dim=0)  # (h, n)
            ct = C[tok].float().repeat_interleave(rep, dim=0)
            decay = torch.exp(delta[tok] * Af)[:, None, None]
            h = decay * h + (delta[tok, :, None] * x[tok].float())[..., None] * bt[:, None, :]
            y[tok] = (h * ct[:, None, :]).sum(-1)
            c = chunk_end.get(tok + 1)
            if c is not None and meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                ssm_state[meta.chunk_dest_slots_list[c]] = h.to(ssm_state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        ssm_state[slot] = h.to(ssm_state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = meta.chunk_end_positions_list[meta.last_chunk_indices[row]]
    y = y + _d_skip(D, x.float())
    return y.masked_fill_(pad_tokens(meta, t)[:, None, None], 0.0).to(x.dtype)
