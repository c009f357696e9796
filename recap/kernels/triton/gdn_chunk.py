"""The chunk-parallel form of the Triton gated delta rule, for GDN (one decay per value head) and KDA (one per
key channel: the PER_CHANNEL flag): the form of fla's chunk_gated_delta_rule / chunk_kda, in three launches, so
that the only sequential walk is one small matmul pair per chunk.

Every metadata chunk (cut at the chunk grid, at every checkpoint position and at the row end) is cut into
pieces of at most `chunk` tokens from its start (tiling.cut_pieces), so every checkpoint is a piece end and its
state is exact. Per piece and value head, with cum = cumsum(g) inside the piece, L[i, j] = exp(cum_i - cum_j)
for i >= j (every exponent <= 0) and the glossary of recap/kernels/gdn.py:

1. _wy_kernel, all pieces at once: T = (I + strictly_lower((beta k) k^T * L))^-1 (forward substitution),
   W = T (beta k exp(cum)), U = T (beta v); cum stored for the next two.
2. _state_kernel, one program per (row, value head, Dv tile), over the row's pieces in order: the piece-start
   state S (stored for step 3), V' = U - W S (written over U), S = exp(cum_last) S + (k exp(cum_last - cum))^T V';
   S at each checkpoint stored into its slot, the row's last one into its running slot (+ slot_positions).
3. _output_kernel, all pieces at once: o = (q exp(cum)) S + (q k^T * L) V'.

KDA's cum is per channel ([T, Hv, Dk]), exp(cum) and exp(cum_last - cum) multiply k, q and S channel-wise,
and the Gram matrices (x k^T * L) become sum_c x_i[c] k_j[c] exp(cum_i[c] - cum_j[c]) (delta_parts.channel_gram:
16-token sub-chunks, the blocks between them as dots against a reference cum, those inside them exactly; every
exponent <= 0).

Dots take their inputs in the storage dtype with fp32 accumulation (exact "ieee" products for fp32 inputs);
the forward substitution and the carried state stay fp32. Rows with a PAD_SLOT_ID running slot read and write
no slot and output zeros. Reference: recap.kernels.gdn.gated_delta_rule_ref.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.tiling import cut_pieces
from recap.kernels.triton.delta_parts import channel_gram, l2norm_rows, unit_lower_inverse, write_state_tile

CHUNK = 64  # tokens per piece of the chunk form (fla's chunk size)
BLOCK_V = 32  # Dv tile of the state walk: Hv * Dv / 32 programs per row
BLOCK_V_OUT = 64  # Dv tile of the outputs and of W/U: each tile recomputes q k^T, so wider than the walk's


@dataclass(frozen=True)
class _Pieces:
    """The step's pieces on the device: token ranges, the chunk each ends (or -1), each row's piece range."""

    tok0: torch.Tensor  # [P] first token
    length: torch.Tensor  # [P] tokens, 1..chunk
    ends_chunk: torch.Tensor  # [P] the metadata chunk the piece ends, or -1
    valid: torch.Tensor  # [P] 0 for the pieces of PAD rows
    row_p0: torch.Tensor  # [B] each row's first piece
    row_np: torch.Tensor  # [B] each row's piece count (0 for PAD rows: they walk nothing)


def _pieces(meta: SSMMetadata, chunk: int, device: torch.device) -> _Pieces:
    """Cut on the host (tiling.cut_pieces) and shipped in one copy (pinned: asynchronous on a GPU)."""
    pieces = cut_pieces(meta.chunks, chunk)
    slots = meta.state_indices_list
    row_p0, row_np = [0] * len(slots), [0] * len(slots)
    for i, p in enumerate(pieces):
        if row_np[p.row] == 0:
            row_p0[p.row] = i
        row_np[p.row] += 1
    row_np = [n if s != PAD_SLOT_ID else 0 for n, s in zip(row_np, slots)]
    parts = [
        [p.start for p in pieces], [p.end - p.start for p in pieces], [p.chunk for p in pieces],
        [int(slots[p.row] != PAD_SLOT_ID) for p in pieces], row_p0, row_np,
    ]  # fmt: skip
    flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64, device="cpu")
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return _Pieces(*flat.split([len(part) for part in parts]))


@triton.jit
def _load_piece(ptr, tt, tm, head, s_t, s_h, cols, cmask, NORM: tl.constexpr, BT: tl.constexpr):
    """[BT, BC] rows tt (masked by tm) of head `head`, fp32; L2-normalised over the columns when NORM."""
    x = tl.load(ptr + tt[:, None] * s_t + head * s_h + cols[None, :], mask=tm[:, None] & cmask[None, :], other=0.0)
    return l2norm_rows(x.to(tl.float32), NORM, BT)


@triton.jit
def _load_cum(cum_ptr, tt, tm, h, sc_t, sc_h, ck, km, PER_CHANNEL: tl.constexpr, BT: tl.constexpr):
    """The piece's cumulative log decay: [BT, BK] per channel, else [BT]; 0 past the piece."""
    if PER_CHANNEL:
        cum = _load_piece(cum_ptr, tt, tm, h, sc_t, sc_h, ck, km, False, BT)
    else:
        cum = tl.load(cum_ptr + tt * sc_t + h * sc_h, mask=tm, other=0.0)
    return cum


@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, cum_ptr, tok0_ptr, len_ptr,
    sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, sw_t, sw_h, su_t, su_h, sc_t, sc_h,
    group, dk, dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, PER_CHANNEL: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Step 1 for one (piece, value head): cum, W and U (all Dv tiles) into their token-major buffers."""
    p, h = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BT)
    tt = tl.load(tok0_ptr + p) + r
    tm = r < tl.load(len_ptr + p)
    ck = tl.arange(0, BK)
    km = ck < dk
    k = _load_piece(k_ptr, tt, tm, h // group, sk_t, sk_h, ck, km, NORM_QK, BT)
    beta = tl.load(b_ptr + tt * sb_t + h * sb_h, mask=tm, other=0.0).to(tl.float32)
    kb = k * beta[:, None]
    dt = w_ptr.dtype.element_ty
    if PER_CHANNEL:
        cum = tl.cumsum(_load_piece(g_ptr, tt, tm, h, sg_t, sg_h, ck, km, False, BT), 0)
        tl.store(cum_ptr + tt[:, None] * sc_t + h * sc_h + ck[None, :], cum, mask=tm[:, None] & km[None, :])
        m = channel_gram(kb, k, cum, True, BT, PREC)
        dec = tl.exp(cum)
    else:
        cum = tl.cumsum(tl.load(g_ptr + tt * sg_t + h * sg_h, mask=tm, other=0.0).to(tl.float32), 0)
        tl.store(cum_ptr + tt * sc_t + h * sc_h, cum, mask=tm)
        decay = tl.exp(tl.where(r[:, None] > r[None, :], cum[:, None] - cum[None, :], float("-inf")))
        m = tl.dot(kb.to(dt), tl.trans(k.to(dt)), input_precision=PREC) * decay
        dec = tl.exp(cum)[:, None]
    t = unit_lower_inverse(m, BT)
    w = tl.dot(t.to(dt), (kb * dec).to(dt), input_precision=PREC)
    tl.store(w_ptr + tt[:, None] * sw_t + h * sw_h + ck[None, :], w.to(dt), mask=tm[:, None] & km[None, :])
    for v0 in range(0, dv, BV):
        cv = v0 + tl.arange(0, BV)
        v = _load_piece(v_ptr, tt, tm, h, sv_t, sv_h, cv, cv < dv, False, BT)
        u = tl.dot(t.to(dt), (v * beta[:, None]).to(dt), input_precision=PREC)
        tl.store(u_ptr + tt[:, None] * su_t + h * su_h + cv[None, :], u.to(dt), mask=tm[:, None] & (cv < dv)[None, :])


@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, cum_ptr, h_ptr, state_ptr, sp_ptr,
    run_ptr, init_ptr, last_ptr, dest_ptr, pos_ptr, tok0_ptr, len_ptr, ends_ptr, p0_ptr, np_ptr,
    sk_t, sk_h, sw_t, sw_h, su_t, su_h, sc_t, sc_h, sh_p, sh_h, sh_k, ss_s, ss_h, ss_k, ss_v,
    group, dk, dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, PER_CHANNEL: tl.constexpr,
    HAS_SP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Step 2 for one (row, value head, Dv tile): the row's pieces in order, from its slot state (or zeros)."""
    row, h, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    run = tl.load(run_ptr + row)
    init = (tl.load(init_ptr + row) != 0) & (run >= 0)
    r, ck = tl.arange(0, BT), tl.arange(0, BK)
    cv = vt * BV + tl.arange(0, BV)
    km, vm = ck < dk, cv < dv
    s_off = h * ss_h + ck[:, None] * ss_k + cv[None, :] * ss_v
    s_mask = km[:, None] & vm[None, :]
    base = tl.where(init, run, 0).to(tl.int64) * ss_s
    s = tl.load(state_ptr + base + s_off, mask=tl.where(init, s_mask, False), other=0.0).to(tl.float32)
    first = (h == 0) & (vt == 0)
    dt = u_ptr.dtype.element_ty
    p0 = tl.load(p0_ptr + row)
    for i in range(0, tl.load(np_ptr + row)):
        p = p0 + i  # a tensor (p0 is loaded), so its int64 cast compiles and interprets alike
        h_off = p.to(tl.int64) * sh_p + h * sh_h + ck[:, None] * sh_k + cv[None, :]
        tl.store(h_ptr + h_off, s.to(h_ptr.dtype.element_ty), mask=s_mask)  # the piece-start state, for step 3
        n = tl.load(len_ptr + p)
        tt = tl.load(tok0_ptr + p) + r
        tm = r < n
        k = _load_piece(k_ptr, tt, tm, h // group, sk_t, sk_h, ck, km, NORM_QK, BT)
        w = _load_piece(w_ptr, tt, tm, h, sw_t, sw_h, ck, km, False, BT)
        u = _load_piece(u_ptr, tt, tm, h, su_t, su_h, cv, vm, False, BT)
        cum = _load_cum(cum_ptr, tt, tm, h, sc_t, sc_h, ck, km, PER_CHANNEL, BT)
        v_new = u - tl.dot(w.to(dt), s.to(dt), input_precision=PREC)
        tl.store(u_ptr + tt[:, None] * su_t + h * su_h + cv[None, :], v_new.to(dt), mask=tm[:, None] & vm[None, :])
        if PER_CHANNEL:  # rows past the piece hold k = 0 (and cum 0: last - 0 <= 0)
            last = tl.sum(tl.where((r == n - 1)[:, None], cum, 0.0), 0)  # (BK,)
            k_dec, s_dec = k * tl.exp(last[None, :] - cum), tl.exp(last)[:, None]
        else:
            last = tl.sum(tl.where(r == n - 1, cum, 0.0), 0)
            k_dec, s_dec = k * tl.exp(last - cum)[:, None], tl.exp(last)
        s = s * s_dec + tl.dot(tl.trans(k_dec.to(dt)), v_new.to(dt), input_precision=PREC)
        c = tl.load(ends_ptr + p)
        dest = tl.load(dest_ptr + c, mask=c >= 0, other=-1)
        pos = tl.load(pos_ptr + c, mask=c >= 0, other=0)
        write_state_tile(state_ptr, sp_ptr, dest, pos, s, ss_s, s_off, s_mask, first, HAS_SP)
    pos = tl.load(pos_ptr + tl.load(last_ptr + row))
    write_state_tile(state_ptr, sp_ptr, run, pos, s, ss_s, s_off, s_mask, first, HAS_SP)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, cum_ptr, h_ptr, o_ptr, tok0_ptr, len_ptr, valid_ptr,
    sq_t, sq_h, sk_t, sk_h, su_t, su_h, sc_t, sc_h, sh_p, sh_h, sh_k, so_t, so_h,
    group, dk, dv, q_scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, PER_CHANNEL: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Step 3 for one (piece, value head, Dv tile): inter-piece q S plus the causal intra-piece part."""
    p, h, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, ck = tl.arange(0, BT), tl.arange(0, BK)
    cv = vt * BV + tl.arange(0, BV)
    km, vm = ck < dk, cv < dv
    tt = tl.load(tok0_ptr + p) + r
    tm = r < tl.load(len_ptr + p)
    q = _load_piece(q_ptr, tt, tm, h // group, sq_t, sq_h, ck, km, NORM_QK, BT) * q_scale
    k = _load_piece(k_ptr, tt, tm, h // group, sk_t, sk_h, ck, km, NORM_QK, BT)
    v_new = _load_piece(u_ptr, tt, tm, h, su_t, su_h, cv, vm, False, BT)
    cum = _load_cum(cum_ptr, tt, tm, h, sc_t, sc_h, ck, km, PER_CHANNEL, BT)
    h_off = p.to(tl.int64) * sh_p + h * sh_h + ck[:, None] * sh_k + cv[None, :]
    s = tl.load(h_ptr + h_off, mask=km[:, None] & vm[None, :], other=0.0)
    dt = u_ptr.dtype.element_ty
    if PER_CHANNEL:
        a, dec = channel_gram(q, k, cum, False, BT, PREC), tl.exp(cum)  # rows past the piece: q = 0
    else:
        causal = (r[:, None] >= r[None, :]) & tm[:, None]  # rows past the piece: cum 0 there, exp would overflow
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        a = tl.dot(q.to(dt), tl.trans(k.to(dt)), input_precision=PREC) * decay
        dec = tl.exp(cum)[:, None]
    o = tl.dot((q * dec).to(dt), s.to(dt), input_precision=PREC)
    o += tl.dot(a.to(dt), v_new.to(dt), input_precision=PREC)
    o = tl.where(tl.load(valid_ptr + p) != 0, o, 0.0)  # PAD rows: S and V' were never written
    tl.store(o_ptr + tt[:, None] * so_t + h * so_h + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=tm[:, None] & vm[None, :])  # fmt: skip


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None,
    chunk: int = CHUNK,
    normalize_qk: bool = False,
) -> torch.Tensor:
    """triton.gdn.gated_delta_rule (same contract) in the chunk-parallel form, pieces of <= `chunk` tokens.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] (GDN: one decay per head) or [T, Hv, Dk] (KDA: one per key
    channel); beta [T, Hv]; state [S, Hv, Dk, Dv].
    """
    t, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    if hv % hk or q.shape != k.shape or g.shape not in ((t, hv), (t, hv, dk)) or beta.shape != (t, hv):
        named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
        shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in named.items())
        raise ValueError(f"{shapes}: g must be [T, Hv] or [T, Hv, Dk], beta [T, Hv], Hv a multiple of Hk")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk {chunk}: a power of two >= 16 (tl.dot)")
    if slot_positions is not None and slot_positions.stride(0) != 1:
        raise ValueError("slot_positions must have a unit stride (the kernel writes slot_positions[slot])")
    per_channel = g.dim() == 3
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if per_channel and g.stride(-1) != 1:
        g = g.contiguous()
    ix = meta.cached(("triton-gdn-chunk", chunk, v.device), lambda: _pieces(meta, chunk, v.device))
    npieces, nrows = ix.tok0.numel(), ix.row_p0.numel()
    dt, dev = v.dtype, v.device
    w, u = torch.empty(t, hv, dk, dtype=dt, device=dev), torch.empty(t, hv, dv, dtype=dt, device=dev)
    cum = torch.empty(t, hv, *g.shape[2:], dtype=torch.float32, device=dev)  # per piece, per channel for KDA
    hs = torch.empty(npieces, hv, dk, dv, dtype=dt, device=dev)  # each piece's start state
    out = torch.empty(t, hv, dv, dtype=dt, device=dev)
    bk, bv, bv_out = _pow2(dk), min(_pow2(dv), BLOCK_V), min(_pow2(dv), BLOCK_V_OUT)
    prec = "ieee" if dt == torch.float32 else "tf32"
    kw = {"BT": chunk, "BK": bk, "NORM_QK": normalize_qk, "PER_CHANNEL": per_channel, "PREC": prec}
    group, strides = hv // hk, (*k.stride()[:2], *w.stride()[:2], *u.stride()[:2], *cum.stride()[:2])
    _wy_kernel[(npieces, hv)](
        k, v, g, beta, w, u, cum, ix.tok0, ix.length, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), *strides[2:], group, dk, dv, BV=bv_out,
        **kw,
    )  # fmt: skip
    sp = meta.state_indices if slot_positions is None else slot_positions  # never written without HAS_SP
    _state_kernel[(nrows, hv, triton.cdiv(dv, bv))](
        k, w, u, cum, hs, state, sp, meta.state_indices, meta.has_initial_state, meta.last_chunk_indices,
        meta.chunk_dest_slots, meta.chunk_end_positions, ix.tok0, ix.length, ix.ends_chunk, ix.row_p0, ix.row_np,
        *strides, *hs.stride()[:3], *state.stride(), group, dk, dv, BV=bv, HAS_SP=slot_positions is not None, **kw,
    )  # fmt: skip
    _output_kernel[(npieces, hv, triton.cdiv(dv, bv_out))](
        q, k, u, cum, hs, out, ix.tok0, ix.length, ix.valid, q.stride(0), q.stride(1), *strides[:2], *strides[4:],
        *hs.stride()[:3], out.stride(0), out.stride(1), group, dk, dv, dk**-0.5 if normalize_qk else 1.0, BV=bv_out,
        **kw,
    )  # fmt: skip
    return out
