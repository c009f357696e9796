"""Triton Mamba1 selective scan (arXiv 2312.00752, Algorithm 2) over packed rows (GPU twin of
recap.kernels.selective_scan), with a state checkpoint at every chunk end that has a destination slot.

Glossary (code name: paper symbol, as in recap.kernels.selective_scan)
- u [T, I]: x, the scan input; delta [T, I]: Delta before bias and softplus; A [I, N]; B, C [T, N]; D [I].
- h [I, N]: the hidden state, fp32; ssm_state [S, I, N] holds one per slot.
- recurrence: h_t = exp(Delta_t A) * h_{t-1} + Delta_t B_t u_t;  y_t = C_t . h_t + D u_t, times silu(z_t).

One program per (row, channel tile) runs the recurrence token by token with its [BLOCK_I, N] state in
registers (as the public Mamba1 kernels do: the work per token is O(I N), so a sequential scan is bound by
memory, not by the steps). Tokens go in groups of BLOCK_T unrolled steps, so the loads of a group do not
wait on the state; the row is walked chunk by chunk and the state is stored at each chunk end with a
destination slot, then into the running slot. Decode (selective_state_update) is the same kernel over
one-token rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata

BLOCK = 16  # tokens per unrolled group
PAD = tl.constexpr(PAD_SLOT_ID)  # a global read inside a kernel must be a constexpr
MIN_PROGRAMS = 512  # channel tiles shrink (to 16) until the grid has this many programs


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20); log1p(e^x) as log(w) e^x / (w - 1), w = 1 + e^x, exact for small e^x."""
    ex = tl.exp(x)
    w = 1.0 + ex
    lp = tl.where(w == 1.0, ex, tl.log(w) * ex / (w - 1.0))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _store_state(s_ptr, pos_ptr, slot, h, off, mask, first_lane, pos, HAS_POS: tl.constexpr):
    """state[slot] = h (masked), and slot_positions[slot] = pos from one lane."""
    tl.store(s_ptr + off, h.to(s_ptr.dtype.element_ty), mask=mask)
    if HAS_POS:
        tl.store(pos_ptr + slot + 0 * off, pos, mask=mask & first_lane)


@triton.jit
def _scan_group(h, t0, end, i, n, A, Dv, bias, valid, u_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr,
                stride_ut, stride_dtt, stride_bt, stride_ct, stride_zt, stride_yt, I, N,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, T_PAD: tl.constexpr):  # fmt: skip
    """BLOCK_T steps from token t0 (steps past `end` leave h as it is); returns h. The group's outputs are
    stored together after its last step: a store between the unrolled steps would hold every later load
    behind it (the compiler cannot tell that y does not alias the inputs), one memory latency per token."""
    mi, mn = i < I, n < N
    steps = tl.arange(0, T_PAD)  # BLOCK_T rounded up to a power of two
    y_all = tl.zeros((T_PAD, BLOCK_I), dtype=tl.float32)
    for k in tl.static_range(BLOCK_T):
        t = t0 + k
        mt = tl.where(t < end, mi, False)  # (bi,): past the chunk end: Delta = 0, the state unchanged
        mtn = tl.where(t < end, mn, False)
        u = tl.load(u_ptr + t * stride_ut + i, mask=mt, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + i, mask=mt, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += bias
        if SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.where(mt, dt, 0.0)
        Bt = tl.load(B_ptr + t * stride_bt + n, mask=mtn, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + t * stride_ct + n, mask=mtn, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1)  # (bi,)
        if HAS_D:
            y += Dv * u
        y_all = tl.where((steps == k)[:, None], y[None, :], y_all)
    tok = t0 + steps  # (bt,)
    m2 = ((tok < end) & (steps < BLOCK_T))[:, None] & mi[None, :]
    if HAS_Z:
        z = tl.load(z_ptr + tok[:, None] * stride_zt + i[None, :], mask=m2, other=0.0).to(tl.float32)
        y_all *= z * tl.sigmoid(z)
    y_all = tl.where(valid, y_all, 0.0)
    tl.store(y_ptr + tok[:, None] * stride_yt + i[None, :], y_all.to(y_ptr.dtype.element_ty), mask=m2)
    return h


@triton.jit
def _scan_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, s_ptr, y_ptr, pos_ptr,
    slots_ptr, init_ptr, last_ptr, cu_ptr, dest_ptr, end_pos_ptr,
    I, N, stride_ut, stride_dtt, stride_ai, stride_bt, stride_ct, stride_zt, stride_ss, stride_si, stride_yt,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    """One row, BLOCK_I channels: the scan over the row's chunks (last dims of u, dt, A, B, C, z, state unit-stride)."""
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # (bi,)
    n = tl.arange(0, BLOCK_N)  # (bn,)
    mi, mn = i < I, n < N
    slot = tl.load(slots_ptr + row)
    valid = slot != PAD  # PAD rows: zeros out, no slot read or written
    s_off = i[:, None] * stride_si + n[None, :]  # (bi, bn)
    mask_s = tl.where(valid, mi[:, None] & mn[None, :], False)
    first_lane = (i[:, None] + n[None, :]) == 0
    h = tl.load(s_ptr + slot * stride_ss + s_off, mask=tl.where(tl.load(init_ptr + row) != 0, mask_s, False), other=0.0)
    h = h.to(tl.float32)
    A = tl.load(A_ptr + i[:, None] * stride_ai + n[None, :], mask=mi[:, None] & mn[None, :], other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_I,), dtype=tl.float32)
    bias = tl.zeros((BLOCK_I,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + i, mask=mi, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + i, mask=mi, other=0.0).to(tl.float32)
    first = tl.load(last_ptr + row - 1, mask=row > 0, other=-1) + 1
    last = tl.load(last_ptr + row)
    for c in range(first, last + 1):
        end = tl.load(cu_ptr + c + 1)
        for t0 in range(tl.load(cu_ptr + c), end, BLOCK_T):
            h = _scan_group(h, t0, end, i, n, A, Dv, bias, valid, u_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr,
                            stride_ut, stride_dtt, stride_bt, stride_ct, stride_zt, stride_yt, I, N,
                            HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, BLOCK_T, BLOCK_I, T_PAD)  # fmt: skip
        dest = tl.load(dest_ptr + c)
        m = tl.where(dest != PAD, mask_s, False)
        pos = tl.load(end_pos_ptr + c)
        _store_state(s_ptr, pos_ptr, dest, h, dest * stride_ss + s_off, m, first_lane, pos, HAS_POS)
    _store_state(s_ptr, pos_ptr, slot, h, slot * stride_ss + s_off, mask_s, first_lane, tl.load(end_pos_ptr + last),
                 HAS_POS)  # fmt: skip


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    ssm_state: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    slot_positions: torch.Tensor | None,
    block: int,
) -> torch.Tensor:
    """The launch. rows: (state_indices, has_initial_state); chunks: (last_chunk_indices, cu_chunk_seqlens,
    chunk_dest_slots, chunk_end_positions)."""
    t, i = u.shape
    n = A.shape[1]
    assert A.shape == (i, n) and B.shape == C.shape == (t, n) and ssm_state.shape[1:] == (i, n), "shapes"
    slots, has_init = rows
    last, cu, dest, end_pos = chunks
    nb = slots.numel()
    assert ssm_state.stride(-1) == 1, "the state is written in place: its last dim must be unit-stride"
    u, delta, A, B, C = (_unit_last(v) for v in (u, delta, A, B, C))
    z = None if z is None else _unit_last(z)
    y = torch.empty(t, i, dtype=u.dtype, device=u.device)
    block_i = 64
    while block_i > 16 and nb * triton.cdiv(i, block_i) < MIN_PROGRAMS:
        block_i //= 2
    block_n = max(2, triton.next_power_of_2(n))
    if nb > 0:
        _scan_kernel[(nb, triton.cdiv(i, block_i))](
            u, delta, A, B, C, u if D is None else D, u if z is None else z, u if delta_bias is None else delta_bias,
            ssm_state, y, slots if slot_positions is None else slot_positions,
            slots, has_init.to(torch.int8), last, cu, dest, end_pos,
            i, n, u.stride(0), delta.stride(0), A.stride(0), B.stride(0), C.stride(0),
            0 if z is None else z.stride(0), ssm_state.stride(0), ssm_state.stride(1), y.stride(0),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
            HAS_POS=slot_positions is not None, BLOCK_T=block, BLOCK_I=block_i, BLOCK_N=block_n,
            T_PAD=max(2, triton.next_power_of_2(block)),  # tl.arange needs a power of two; 1 is avoided
            num_warps=1 if block_i * block_n <= 256 else 2 if block_i * block_n <= 512 else 4,
        )  # fmt: skip
    return y


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    ssm_state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    block: int = BLOCK,
) -> torch.Tensor:
    """Selective scan of every row from its slot state; writes running and checkpoint slots. PAD rows: zeros.

    block: tokens per unrolled group. Reference: selective_scan_ref. A decode batch takes this same kernel
    (one chunk per row): the torch kernel's decode route gives the same states, outputs and positions.
    """
    rows = (meta.state_indices, meta.has_initial_state)
    chunks = (meta.last_chunk_indices, meta.cu_chunk_seqlens, meta.chunk_dest_slots, meta.chunk_end_positions)
    return _scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, ssm_state, rows, chunks, slot_positions, block)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: h = exp(Delta A) h + Delta B x in state[slot]; PAD rows output zeros.

    positions ([B], absolute token positions) is required with slot_positions, which records positions + 1.
    has_initial_state (optional [B] bool): rows marked False start from a zero state. Reference:
    selective_state_update_ref. The scan kernel over B one-token rows (one chunk each, no checkpoint), with
    index tensors built on the device (no host sync).
    """
    if slot_positions is not None and positions is None:
        raise ValueError("slot_positions needs positions")
    b = x.shape[0]
    ar = torch.arange(b + 1, device=x.device)
    init = torch.ones(b, dtype=torch.bool, device=x.device) if has_initial_state is None else has_initial_state
    no_dest = torch.full((b,), PAD_SLOT_ID, dtype=torch.int64, device=x.device)
    end_pos = ar[1:] if positions is None else positions + 1
    chunks = (ar[:b], ar, no_dest, end_pos)
    return _scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, state, (state_indices, init), chunks, slot_positions, 1)
