"""Triton Mamba2 SSD decode: one token per row, the state updated in place in its slot (glossary: ssd.py).

    h = exp(Delta A) h + Delta x B^T  (per head: a scalar decay, a rank-1 update of the [P, N] state)
    y = h C + D x

ssd_state_update has the signature and side effects of recap.kernels.ssd_decode.ssd_state_update. One
program per (row, head, p-tile) holds a [BP, N] tile of the state in registers: one read and one write of
the state, the update and the mat-vec fused. update_rows also copies the new state to a per-row
checkpoint slot (ssd.ssd's decode batches: a token that completes a block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.core.output import PAD_SLOT_ID

NO_LIMIT = (0.0, float("inf"))
MAX_BLOCK_P = 64  # head-dim tile: [BP, N] fp32 state tile per program


@triton.jit
def step_size(dt, bias, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, lo, hi):
    """Delta from raw dt + bias (fp32), as varlen.process_dt: softplus (threshold 20), then the clamp."""
    v = dt + bias
    if SOFTPLUS:
        # log(1 + e^v) ~ e^v below -15 (relative error < 2e-7): keeps tiny steps exact without log1p
        ev = tl.exp(tl.minimum(v, 20.0))
        v = tl.where(v > 20.0, v, tl.where(v < -15.0, ev, tl.log(1.0 + ev)))
    if HAS_LIMIT:
        v = tl.minimum(tl.maximum(v, lo), hi)
    return v


@triton.jit
def masked_by(mask, cond):
    """mask & cond for a scalar cond, spelled so that the interpreter can broadcast it (it fails on a scalar
    bool and a block of bools)."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


def dt_args(dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float], like: torch.Tensor):
    """(bias tensor, HAS_BIAS, SOFTPLUS, HAS_LIMIT, lo, hi): the launch arguments of step_size."""
    has_bias = dt_bias is not None
    bias = dt_bias if dt_bias is not None else like
    return bias, has_bias, bool(dt_softplus), tuple(dt_limit) != NO_LIMIT, float(dt_limit[0]), float(dt_limit[1])


def d_args(D: torch.Tensor | None, nh: int, like: torch.Tensor) -> tuple[torch.Tensor, bool, int, int]:
    """(D viewed as [H, P or 1], HAS_D, head stride, p stride): D is [H] or [H, P]."""
    if D is None:
        return like, False, 0, 0
    d = D.reshape(nh, -1)
    return d, True, d.stride(0), 0 if d.shape[1] == 1 else d.stride(1)


def block_p(p: int) -> int:
    return min(max(16, triton.next_power_of_2(p)), MAX_BLOCK_P)


@triton.jit
def _update_kernel(
    state, x, dt, A, B, C, D, bias, y, idx, init, dest, slot_pos, pos,
    s_s, s_h, s_p, s_n, x_t, x_h, x_p, y_t, y_h, dt_t, dt_h, b_t, b_g, b_n, c_t, c_g, c_n, d_h, d_p,
    P, N, REP, lo, hi,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_D: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_DEST: tl.constexpr, WRITE_POS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    hd = tl.program_id(1)
    pt = tl.program_id(2)
    g = hd // REP
    p = pt * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    pm, nm = p < P, n < N
    slot = tl.load(idx + r)
    valid = slot != -1
    start = valid
    if HAS_INIT:
        start = start & (tl.load(init + r) != 0)
    tile = pm[:, None] & nm[None, :]
    off = p[:, None] * s_p + n[None, :] * s_n + hd * s_h
    h = tl.load(state + tl.maximum(slot, 0) * s_s + off, mask=masked_by(tile, start), other=0.0).to(tl.float32)
    b_ = 0.0
    if HAS_BIAS:
        b_ = tl.load(bias + hd).to(tl.float32)
    delta = step_size(tl.load(dt + r * dt_t + hd * dt_h).to(tl.float32), b_, SOFTPLUS, HAS_LIMIT, lo, hi)
    xv = tl.load(x + r * x_t + hd * x_h + p * x_p, mask=pm, other=0.0).to(tl.float32)
    bv = tl.load(B + r * b_t + g * b_g + n * b_n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(C + r * c_t + g * c_g + n * c_n, mask=nm, other=0.0).to(tl.float32)
    decay = tl.exp(delta * tl.load(A + hd).to(tl.float32))
    h = decay * h + (delta * xv)[:, None] * bv[None, :]
    out = tl.sum(h * cv[None, :], axis=1)  # (BP,)
    if HAS_D:
        out += tl.load(D + hd * d_h + p * d_p, mask=pm, other=0.0).to(tl.float32) * xv
    tl.store(y + r * y_t + hd * y_h + p, tl.where(valid, out, 0.0).to(y.dtype.element_ty), mask=pm)
    hs = h.to(state.dtype.element_ty)
    tl.store(state + tl.maximum(slot, 0) * s_s + off, hs, mask=masked_by(tile, valid))
    first = (hd == 0) & (pt == 0)
    written = (tl.load(pos + r) + 1).to(slot_pos.dtype.element_ty)  # tokens folded into the state
    if HAS_DEST:
        d = tl.load(dest + r)
        keep = valid & (d != -1)
        tl.store(state + tl.maximum(d, 0) * s_s + off, hs, mask=masked_by(tile, keep))
        if WRITE_POS:
            tl.store(slot_pos + tl.maximum(d, 0), written, mask=keep & first)
    if WRITE_POS:
        tl.store(slot_pos + tl.maximum(slot, 0), written, mask=valid & first)


def update_rows(
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
    slot_positions: torch.Tensor | None,
    positions: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    dest_slots: torch.Tensor | None,
) -> torch.Tensor:
    """ssd_state_update, and state[dest_slots[r]] = the new state of row r where dest_slots[r] != PAD_SLOT_ID
    (its slot_positions entry: positions[r] + 1 as well)."""
    if slot_positions is not None and positions is None:
        raise ValueError("slot_positions needs positions")
    b, nh, p = x.shape
    g, n = B.shape[1:]
    assert nh % g == 0 and state.shape[1:] == (nh, p, n), "state must be [S, H, P, N]"
    y = torch.empty(b, nh, p, dtype=x.dtype, device=x.device)
    bias, has_bias, soft, has_limit, lo, hi = dt_args(dt_bias, dt_softplus, dt_limit, A)
    d, has_d, d_h, d_p = d_args(D, nh, A)
    bp = block_p(p)
    _update_kernel[(b, nh, triton.cdiv(p, bp))](
        state, x, dt, A, B, C, d, bias, y, state_indices,
        has_initial_state if has_initial_state is not None else state_indices,
        dest_slots if dest_slots is not None else state_indices,
        slot_positions if slot_positions is not None else state_indices,
        positions if positions is not None else state_indices,
        *state.stride(), *x.stride(), y.stride(0), y.stride(1), *dt.stride(), *B.stride(), *C.stride(), d_h, d_p,
        p, n, nh // g, lo, hi,
        HAS_BIAS=has_bias, SOFTPLUS=soft, HAS_LIMIT=has_limit, HAS_D=has_d,
        HAS_INIT=has_initial_state is not None, HAS_DEST=dest_slots is not None,
        WRITE_POS=slot_positions is not None, BP=bp, BN=max(16, triton.next_power_of_2(n)),
    )  # fmt: skip
    return y


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

    slot_positions[slot] = positions + 1 for every row written; rows with has_initial_state False start from
    zeros. Running slots must be distinct. Reference: recap.kernels.ssd_decode.ssd_state_update_ref.
    """
    assert PAD_SLOT_ID == -1, "the kernel tests slot != -1"
    return update_rows(
        state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, state_indices, slot_positions, positions,
        has_initial_state, None,
    )  # fmt: skip
