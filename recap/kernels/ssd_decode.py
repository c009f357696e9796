"""Mamba2 SSD decode: one token per row, the state updated in place in its slot (the glossary is ssd.py's).

    h = exp(Delta A) h + Delta x B^T  (per head: a scalar decay, a rank-1 update of the [P, N] state)
    y = h C + D x

ssd_state_update is the fast path (called by the Mamba2 layer and by ssd on decode batches);
ssd_state_update_ref is its plain per-row twin, with the same signature and side effects.
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.varlen import decode_rows, process_dt, record_decode_positions


def d_skip(D: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | float:
    """D x for x (..., H, P); D is [H] (or [H, P])."""
    if D is None:
        return 0.0
    return x * D.float().reshape(D.shape[0], -1)


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
    Running slots must be distinct. Reference: ssd_state_update_ref.

    Fast path: the state is updated in place, row by row, on the slot's own memory (an fp32 cache; other
    dtypes go through an fp32 copy): two passes over the state and one mat-vec for y, no gather or scatter.
    A slot is a [H, P, N] block (768 KiB at H=24, P=64, N=128) that stays in cache across the three ops.
    """
    b, nh, p = x.shape
    g, n = B.shape[1:]
    rep = nh // g
    y = torch.zeros(b, nh, p, dtype=torch.float32, device=x.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        d = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, h)
        # per-row views, made once (unbind), shaped to broadcast against a slot viewed as (g, r, p, n)
        decay = torch.exp(d * A.float()).view(b, g, rep, 1, 1).unbind(0)
        dx = (x.float() * d[..., None]).view(b, g, rep, p, 1).unbind(0)  # Delta x
        bf = B.float().view(b, g, 1, 1, n).unbind(0)
        cf = C.float().view(b, g, n, 1).unbind(0)
        yr = y.view(b, g, rep * p, 1).unbind(0)
        in_place = state.dtype == torch.float32 and state.is_contiguous()
        for r, slot, init in rows:
            h = state[slot] if in_place else state[slot].float()  # (h, p, n)
            if not init:
                h.zero_()
            hg = h.view(g, rep, p, n)
            hg.mul_(decay[r]).addcmul_(dx[r], bf[r])
            if g == 1:  # y = h C: one mat-vec (a little faster than a batch-1 bmm)
                torch.mv(h.view(rep * p, n), cf[r].view(n), out=yr[r].view(rep * p))
            else:
                torch.matmul(hg.view(g, rep * p, n), cf[r], out=yr[r])
            if not in_place:
                state[slot] = h.to(state.dtype)
        if D is not None:
            y += d_skip(D, x.float())
        if len(rows) < b:
            y.masked_fill_((state_indices == PAD_SLOT_ID)[:, None, None], 0.0)
    record_decode_positions(slot_positions, state_indices, positions)
    return y.to(x.dtype)


def ssd_state_update_ref(
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
    """Plain per-row reference of ssd_state_update (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    rep = x.shape[1] // B.shape[1]
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        h = torch.zeros(state.shape[1:], device=x.device)
        if has_initial_state is None or bool(has_initial_state[row]):
            h = state[slot].float()
        delta = process_dt(dt[row], dt_bias, dt_softplus, dt_limit)  # (h,)
        bt = B[row].float().repeat_interleave(rep, dim=0)  # (h, n)
        ct = C[row].float().repeat_interleave(rep, dim=0)
        h = torch.exp(delta * A.float())[:, None, None] * h + (delta[:, None] * x[row].float())[..., None] * bt[:, None]
        y = (h * ct[:, None, :]).sum(-1) + d_skip(D, x[row].float())
        out[row] = y.to(x.dtype)
        state[slot] = h.to(state.dtype)
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
    return out
