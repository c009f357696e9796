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


SUB = tl.constexpr(16)  # channel_gram's sub-chunk: rows per exactly computed diagonal block


@triton.jit
def channel_gram(x, k, cum, STRICT: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """[BT, BT] lower: sum_c x_i[c] k_j[c] exp(cum_i[c] - cum_j[c]) for j < i (STRICT) or j <= i, zeros above.

    x, k, cum [BT, BK] (cum: the per-channel cumulative log decay inside the piece, non-increasing). A
    per-channel decay does not factor out of one dot (exp(cum_i) exp(-cum_j) overflows once cum is far below 0),
    so, as fla's chunk_kda does, the piece is cut into sub-chunks of SUB rows:
    - rows of a later sub-chunk against sub-chunk b's columns: one dot per b, both sides scaled against the cum of
      b's last row e (cum_i <= cum_e <= cum_j, so both factors are <= 1: strong decays underflow to 0);
    - within a sub-chunk, exactly: one column offset at a time for every sub-chunk at once, each exponent the
      difference cum_i - cum_j itself (<= 0 wherever it is kept).
    The clamps at 0 only touch entries that are masked out (or multiply rows and columns past the piece, which
    hold zeros)."""
    r = tl.arange(0, BT)
    blk = r // SUB
    out = tl.zeros([BT, BT], dtype=tl.float32)
    for b in tl.static_range(BT // SUB - 1):
        e = b * SUB + SUB - 1
        ref = tl.sum(tl.where((r == e)[:, None], cum, 0.0), 0)  # (BK,)
        xs = tl.where((r > e)[:, None], x * tl.exp(tl.minimum(cum - ref[None, :], 0.0)), 0.0)
        ks = tl.where((blk == b)[:, None], k * tl.exp(tl.minimum(ref[None, :] - cum, 0.0)), 0.0)
        out += tl.dot(xs, tl.trans(ks), input_precision=PREC)
    for o in range(SUB):
        j = blk * SUB + o  # (BT,): each row's column at offset o of its own sub-chunk
        at = tl.broadcast_to(j[:, None], k.shape)
        kj, cj = tl.gather(k, at, 0), tl.gather(cum, at, 0)  # rows j of k and cum, row by row
        val = tl.sum(x * kj * tl.exp(tl.minimum(cum - cj, 0.0)), 1)
        keep = r > j if STRICT else r >= j  # a constexpr condition: one branch compiled
        out = tl.where((r[None, :] == j[:, None]) & keep[:, None], val[:, None], out)
    return out
