"""Triton helpers shared by the gated delta rule kernels (triton/gdn.py: per token and per piece; triton/gdn_chunk.py:
the chunk-parallel form): in-kernel L2 normalisation, one state tile's slot write, the unit lower inverse, and
the intra-piece Gram matrix under a decay per key channel (KDA)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2norm_rows(x, NORM: tl.constexpr, BT: tl.constexpr):
    """x / sqrt(sum x^2 + 1e-6) over the channels (recap.kernels.gdn.l2_normalize) when NORM (KDA's q and k);
    x is [BT, BK] (a piece) or [BK] (one token, BT 1)."""
    if NORM:
        if BT > 1:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        if BT == 1:
            x = x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)
    return x


@triton.jit
def write_state_tile(state_ptr, sp_ptr, slot, pos, s, ss_s, s_off, s_mask, first, HAS_SP: tl.constexpr):
    """state[slot] tile = s, and slot_positions[slot] = pos by the first program, unless slot is a pad."""
    ok = slot >= 0
    base = tl.where(ok, slot, 0).to(tl.int64) * ss_s
    tl.store(state_ptr + base + s_off, s.to(state_ptr.dtype.element_ty), mask=tl.where(ok, s_mask, False))
    if HAS_SP:
        tl.store(sp_ptr + tl.where(ok, slot, 0), pos.to(sp_ptr.dtype.element_ty), mask=ok & first)


@triton.jit
def unit_lower_inverse(m, BT: tl.constexpr):
    """(I + m)^-1 for a strictly lower m [BT, BT], by forward substitution one row at a time."""
    r = tl.arange(0, BT)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BT):
        row = r[:, None] == i
        mi = tl.sum(tl.where(row, m, 0.0), 0)  # row i of m: zeros at j >= i, so rows j >= i of t are unused
        ti = tl.where(r == i, 1.0, 0.0) - tl.sum(mi[:, None] * t, 0)
        t = tl.where(row, ti[None, :], t)
    return t


@triton.jit
def channel_gram(x, k, cum, STRICT: tl.constexpr, BT: tl.constexpr):
    """[BT, BT] lower: sum_c x_i[c] k_j[c] exp(cum_i[c] - cum_j[c]) for j < i (STRICT) or j <= i, zeros above.

    x, k, cum [BT, BK] (cum: the per-channel cumulative log decay inside the piece). A per-channel decay does
    not factor out of a dot (exp(cum_i) exp(-cum_j) overflows once cum is far below 0), so the matrix is made a
    column at a time with each exponent a difference, <= 0 wherever it is kept: strong decays underflow to 0."""
    r = tl.arange(0, BT)
    out = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(BT):
        row = r[:, None] == j
        kj = tl.sum(tl.where(row, k, 0.0), 0)  # (BK,)
        cj = tl.sum(tl.where(row, cum, 0.0), 0)
        w = kj[None, :] * tl.exp(tl.minimum(cum - cj[None, :], 0.0))  # (BT, BK); rows above j masked below
        keep = r > j if STRICT else r >= j  # a constexpr condition: one branch compiled
        out = tl.where((r[None, :] == j) & keep[:, None], tl.sum(x * w, 1)[:, None], out)
    return out
