"""Triton Mamba2 SSD over packed variable-length rows (glossary and algorithm: recap/kernels/ssd.py).

ssd has the signature and side effects of recap.kernels.ssd.ssd. The step is cut as the CPU
kernel cuts it (tiling.plan_segments): chunks of <= sub_chunk tokens inside each chunk-grid cell (steps 1
and 4), and segments, the chunks cut again at every checkpoint inside them (steps 2-3), so every checkpoint
is a segment end. Three kernels:
1. _segment_kernel, one program per (segment, head, [BP, BN] state tile): the state the segment adds,
   sum_j exp(dA_{j+1} + .. + dA_end) Delta_j x_j B_j^T (one tl.dot over the segment's tokens), and the
   segment's total decay.
2. _passing_kernel, one program per (row, head, state tile): from the slot state (or zeros), walks the row's
   segments in order, h = exp(decay) h + contribution; writes each checkpoint's state into its slot, the
   state at each chunk start over that chunk's first contribution (read by 3), the final state into the
   running slot, and the positions into slot_positions. The walk is sequential and latency-bound: small
   tiles, and PASS_K segments' loads issued together each round.
3. _output_kernel, one program per (chunk, head, p-tile): Y = (L * C B^T) (Delta x) + exp(cs) C h_start
   + D x, L[i, j] = exp(dA_{j+1} + .. + dA_i).
Decay sums are taken directly over their own tokens (masked [Q, Q] sums), never as differences of cumsums,
which cancel badly in fp32 on fast-decaying heads. Decode batches go to ssd_decode.update_rows, which also
copies a block-completing row's new state to its checkpoint slot.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.ssd import SUB_CHUNK
from recap.kernels.triton.ssd_decode import block_p, d_args, dt_args, masked_by, step_size, update_rows

PASS_TILE = 32  # [32, 32] state tiles in the state passing
PASS_K = 2  # segments whose contributions the state passing loads at once (H100: 2 beat 1, 4 and 8)


@triton.jit
def _load_steps(dt, bias, A, tok0, L, hd, dt_t, dt_h, lo, hi, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                HAS_LIMIT: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    """(Delta, dA) of BQ positions from token tok0 (zeros past L: decay 1, no input)."""
    q = tl.arange(0, BQ)
    qm = q < L
    b_ = 0.0
    if HAS_BIAS:
        b_ = tl.load(bias + hd).to(tl.float32)
    raw = tl.load(dt + (tok0 + q) * dt_t + hd * dt_h, mask=qm, other=0.0).to(tl.float32)
    delta = tl.where(qm, step_size(raw, b_, SOFTPLUS, HAS_LIMIT, lo, hi), 0.0)
    return delta, delta * tl.load(A + hd).to(tl.float32)


@triton.jit
def _segment_kernel(
    x, dt, A, B, bias, contrib, seg_decay, seg_tok0, seg_len,
    x_t, x_h, x_p, dt_t, dt_h, b_t, b_g, b_n, P, N, NH, REP, lo, hi,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    tile = tl.program_id(2)
    n_pt = tl.cdiv(P, BP)
    p = (tile % n_pt) * BP + tl.arange(0, BP)
    n = (tile // n_pt) * BN + tl.arange(0, BN)
    tok0 = tl.load(seg_tok0 + s)
    L = tl.load(seg_len + s)
    q = tl.arange(0, BQ)
    qm = q < L
    delta, dA = _load_steps(dt, bias, A, tok0, L, hd, dt_t, dt_h, lo, hi, HAS_BIAS, SOFTPLUS, HAS_LIMIT, BQ)
    # to_end[j] = dA_{j+1} + .. + dA_{L-1}: a masked sum over k > j (dA is 0 past L)
    to_end = tl.sum(tl.where(q[:, None] > q[None, :], dA[:, None], 0.0), axis=0)  # (BQ,) over j
    w = tl.exp(to_end) * delta  # (BQ,)
    xt = tl.load(x + (tok0 + q[None, :]) * x_t + hd * x_h + p[:, None] * x_p, mask=qm[None, :] & (p[:, None] < P),
                 other=0.0).to(tl.float32)  # (BP, BQ)  # fmt: skip
    bm = tl.load(B + (tok0 + q[:, None]) * b_t + (hd // REP) * b_g + n[None, :] * b_n,
                 mask=qm[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)  # (BQ, BN)  # fmt: skip
    st = tl.dot(xt * w[None, :], bm, input_precision=PREC)  # (BP, BN)
    off = ((s * NH + hd) * P + p[:, None]) * N + n[None, :]
    tl.store(contrib + off, st, mask=(p[:, None] < P) & (n[None, :] < N))
    tl.store(seg_decay + s * NH + hd, tl.sum(dA, axis=0), mask=tile == 0)


@triton.jit
def _passing_kernel(
    state, contrib, seg_decay, idx, init, slot_pos, row_seg0, row_nseg, row_pos, seg_first, seg_dest, seg_pos,
    s_s, s_h, s_p, s_n, P, N, NH,
    WRITE_POS: tl.constexpr, K: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    hd = tl.program_id(1)
    tile = tl.program_id(2)
    n_pt = tl.cdiv(P, BP)
    p = (tile % n_pt) * BP + tl.arange(0, BP)
    n = (tile // n_pt) * BN + tl.arange(0, BN)
    slot = tl.load(idx + r)
    valid = slot != -1
    m = masked_by((p[:, None] < P) & (n[None, :] < N), valid)  # a PAD row reads and writes nothing
    s_off = hd * s_h + p[:, None] * s_p + n[None, :] * s_n
    start = valid & (tl.load(init + r) != 0)
    h = tl.load(state + tl.maximum(slot, 0) * s_s + s_off, mask=masked_by(m, start), other=0.0).to(tl.float32)
    s0 = tl.load(row_seg0 + r)
    ns = tl.where(valid, tl.load(row_nseg + r), 0)
    first_tile = (hd == 0) & (tile == 0)
    kr = tl.arange(0, K)
    c_off = (hd * P + p[:, None]) * N + n[None, :]  # a segment's tile in contrib, past its segment offset
    for i0 in range(0, ns, K):  # K segments a round: their loads issued together, then K updates in order
        seg = s0 + i0 + kr  # (K,)
        live = (i0 + kr) < ns
        c3 = tl.load(contrib + seg[:, None, None] * NH * P * N + c_off[None, :, :],
                     mask=live[:, None, None] & m[None, :, :], other=0.0)  # (K, BP, BN)  # fmt: skip
        decay = tl.exp(tl.load(seg_decay + seg * NH + hd, mask=live, other=0.0))  # 1 past the row's end
        first = tl.load(seg_first + seg, mask=live, other=0)
        dest = tl.load(seg_dest + seg, mask=live, other=-1)
        if WRITE_POS:
            ckpt = live & (dest != -1)
            pos = tl.load(seg_pos + seg, mask=ckpt, other=0).to(slot_pos.dtype.element_ty)
            tl.store(slot_pos + tl.maximum(dest, 0), pos, mask=masked_by(ckpt, first_tile))
        for j in tl.static_range(K):
            sel = kr == j
            s = s0 + i0 + j
            first_j = tl.sum(tl.where(sel, first, 0), axis=0)
            tl.store(contrib + s * NH * P * N + c_off, h, mask=masked_by(m, first_j != 0))  # h at the chunk start
            h = tl.sum(tl.where(sel, decay, 0.0), axis=0) * h + tl.sum(tl.where(sel[:, None, None], c3, 0.0), axis=0)
            dest_j = tl.sum(tl.where(sel, dest, 0), axis=0)  # the checkpoint slot, or -1
            tl.store(state + tl.maximum(dest_j, 0) * s_s + s_off, h.to(state.dtype.element_ty),
                     mask=masked_by(m, dest_j != -1))  # fmt: skip
    tl.store(state + tl.maximum(slot, 0) * s_s + s_off, h.to(state.dtype.element_ty), mask=m)
    if WRITE_POS:
        pos = tl.load(row_pos + r).to(slot_pos.dtype.element_ty)
        tl.store(slot_pos + tl.maximum(slot, 0), pos, mask=first_tile & valid)


@triton.jit
def _output_kernel(
    x, dt, A, B, C, D, bias, y, h_start, chunk_tok0, chunk_len, chunk_seg0, chunk_valid,
    x_t, x_h, x_p, y_t, y_h, dt_t, dt_h, b_t, b_g, b_n, c_t, c_g, c_n, d_h, d_p, P, N, NH, REP, lo, hi,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_D: tl.constexpr,
    BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    pm = p < P
    g = hd // REP
    tok0 = tl.load(chunk_tok0 + c)
    L = tl.load(chunk_len + c)
    q = tl.arange(0, BQ)
    qm = q < L
    delta, dA = _load_steps(dt, bias, A, tok0, L, hd, dt_t, dt_h, lo, hi, HAS_BIAS, SOFTPLUS, HAS_LIMIT, BQ)
    # segsum[i, j] = dA_{j+1} + .. + dA_i: a cumsum over i of dA_i masked to i > j
    seg = tl.cumsum(tl.where(q[:, None] > q[None, :], dA[:, None], 0.0), axis=0)  # (BQ, BQ)
    decay = tl.where(q[:, None] >= q[None, :], tl.exp(seg), 0.0)  # L, causal
    cs = tl.cumsum(dA, axis=0)  # (BQ,): dA_0 + .. + dA_i, decay from the chunk start
    cb = tl.zeros((BQ, BQ), dtype=tl.float32)
    ch = tl.zeros((BQ, BP), dtype=tl.float32)
    h_off = (tl.load(chunk_seg0 + c) * NH + hd) * P * N
    for k0 in tl.static_range(0, BN, BK):  # the state dim in BK slices
        k = k0 + tl.arange(0, BK)
        km = k < N
        cm = tl.load(C + (tok0 + q[:, None]) * c_t + g * c_g + k[None, :] * c_n,
                     mask=qm[:, None] & km[None, :], other=0.0).to(tl.float32)  # (BQ, BK)  # fmt: skip
        bt = tl.load(B + (tok0 + q[None, :]) * b_t + g * b_g + k[:, None] * b_n,
                     mask=qm[None, :] & km[:, None], other=0.0).to(tl.float32)  # (BK, BQ)  # fmt: skip
        ht = tl.load(h_start + h_off + p[None, :] * N + k[:, None], mask=pm[None, :] & km[:, None], other=0.0)
        cb += tl.dot(cm, bt, input_precision=PREC)  # C_i . B_j
        ch += tl.dot(cm, ht, input_precision=PREC)  # C_i . h_start[p]
    xm = tl.load(x + (tok0 + q[:, None]) * x_t + hd * x_h + p[None, :] * x_p, mask=qm[:, None] & pm[None, :],
                 other=0.0).to(tl.float32)  # (BQ, BP)  # fmt: skip
    out = tl.dot(cb * decay * delta[None, :], xm, input_precision=PREC) + tl.exp(cs)[:, None] * ch
    if HAS_D:
        out += tl.load(D + hd * d_h + p * d_p, mask=pm, other=0.0).to(tl.float32)[None, :] * xm
    out = tl.where(tl.load(chunk_valid + c) != 0, out, 0.0)  # PAD rows: zeros
    tl.store(y + (tok0 + q[:, None]) * y_t + hd * y_h + p[None, :], out.to(y.dtype.element_ty),
             mask=qm[:, None] & pm[None, :])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Index:
    """The plan as the kernels read it: per segment, per row and per chunk int64 vectors (one copy)."""

    seg_tok0: torch.Tensor  # [S] packed offset of each segment's first token
    seg_len: torch.Tensor
    seg_first: torch.Tensor  # 1 where the segment starts its chunk
    seg_dest: torch.Tensor  # checkpoint slot written at the segment end, or PAD_SLOT_ID
    seg_pos: torch.Tensor  # its position
    row_seg0: torch.Tensor  # [B] each row's first segment (a row's segments are contiguous)
    row_nseg: torch.Tensor
    row_pos: torch.Tensor  # the position of the row's final state
    chunk_tok0: torch.Tensor  # [C]
    chunk_len: torch.Tensor
    chunk_seg0: torch.Tensor  # the chunk's first segment (its contribution slot holds h at the chunk start)
    chunk_valid: torch.Tensor  # 0 for chunks of PAD rows
    max_len: int  # the longest chunk
    max_seg: int  # the longest segment


def _index(meta: SSMMetadata, sub_chunk: int, device: torch.device) -> _Index:
    """Cut the step as the CPU kernel does (tiling.plan_segments, in Python lists) and ship the cut to the
    device in one copy (a blocking host-to-GPU copy per index tensor would stall the stream)."""
    plan = meta.segment_plan(sub_chunk)
    nb, ns, nc = len(meta.state_indices_list), len(plan.segments), len(plan.chunk_last_seg)
    chunk_len = [plan.segments[s][2] for s in plan.chunk_last_seg]
    chunk_tok0 = [0] * nc
    for c in range(1, nc):
        chunk_tok0[c] = chunk_tok0[c - 1] + chunk_len[c - 1]
    chunk_seg0, row_seg0, row_nseg = [0] * nc, [0] * nb, [0] * nb
    for s, ((c, a, _), row) in enumerate(zip(plan.segments, plan.seg_rows)):
        if a == 0:
            chunk_seg0[c] = s
        if row_nseg[row] == 0:
            row_seg0[row] = s
        row_nseg[row] += 1
    seg_dest, seg_pos = [PAD_SLOT_ID] * ns, [0] * ns
    for s, slot, pos in plan.checkpoints:
        seg_dest[s], seg_pos[s] = slot, pos
    row_pos = [0] * nb
    for c, _, pos in plan.running:
        row_pos[plan.seg_rows[plan.chunk_last_seg[c]]] = pos
    valid = [int(slot != PAD_SLOT_ID) for slot in meta.state_indices_list]
    parts = [
        [chunk_tok0[c] + a for c, a, _ in plan.segments], [b - a for _, a, b in plan.segments],
        [int(a == 0) for _, a, _ in plan.segments], seg_dest, seg_pos, row_seg0, row_nseg, row_pos,
        chunk_tok0, chunk_len, chunk_seg0, [valid[plan.seg_rows[s]] for s in plan.chunk_last_seg],
    ]  # fmt: skip
    # built on the host whatever torch's default device is (pinned below; a CUDA default would put it there)
    flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64, device="cpu")
    if device.type == "cuda":  # pinned: an asynchronous copy
        flat = flat.pin_memory().to(device, non_blocking=True)
    return _Index(*flat.split([len(part) for part in parts]), max_len=max(chunk_len), max_seg=max(parts[1]))


def ssd(
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
    if meta.is_decode:  # one chunk per row: a chunk's destination slot is its row's checkpoint
        dest = meta.chunk_dest_slots if any(d != PAD_SLOT_ID for d in meta.chunk_dest_slots_list) else None
        return update_rows(
            ssm_state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, meta.state_indices, slot_positions,
            meta.chunk_end_positions - 1, meta.has_initial_state, dest,
        )  # fmt: skip
    t, nh, p = x.shape
    g, n = B.shape[1:]
    assert nh % g == 0 and ssm_state.shape[1:] == (nh, p, n), "ssm_state must be [S, H, P, N]"
    ix = meta.cached(("triton-ssd-index", sub_chunk, x.device), lambda: _index(meta, sub_chunk, x.device))
    ns, nb, nc = ix.seg_len.numel(), ix.row_nseg.numel(), ix.chunk_len.numel()
    bias, has_bias, soft, has_limit, lo, hi = dt_args(dt_bias, dt_softplus, dt_limit, A)
    dt_kw = {"HAS_BIAS": has_bias, "SOFTPLUS": soft, "HAS_LIMIT": has_limit}
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 products
    bp, bn = block_p(p), max(16, triton.next_power_of_2(n))
    bnt = min(bn, 64)  # state tile [bp, bnt] of the segment kernel
    contrib = torch.empty(ns, nh, p, n, dtype=torch.float32, device=x.device)  # then h at chunk starts
    seg_decay = torch.empty(ns, nh, dtype=torch.float32, device=x.device)
    _segment_kernel[(ns, nh, triton.cdiv(p, bp) * triton.cdiv(n, bnt))](
        x, dt, A, B, bias, contrib, seg_decay, ix.seg_tok0, ix.seg_len,
        *x.stride(), *dt.stride(), *B.stride(), p, n, nh, nh // g, lo, hi,
        **dt_kw, BQ=max(16, triton.next_power_of_2(ix.max_seg)), BP=bp, BN=bnt, PREC=prec,
    )  # fmt: skip
    # the walk is latency-bound: small tiles (more programs in flight), PASS_K segments loaded a round
    pp, pn = min(bp, PASS_TILE), min(bn, PASS_TILE)
    sp = slot_positions if slot_positions is not None else ix.seg_pos  # a placeholder pointer when None
    _passing_kernel[(nb, nh, triton.cdiv(p, pp) * triton.cdiv(n, pn))](
        ssm_state, contrib, seg_decay, meta.state_indices, meta.has_initial_state, sp, ix.row_seg0, ix.row_nseg,
        ix.row_pos, ix.seg_first, ix.seg_dest, ix.seg_pos, *ssm_state.stride(), p, n, nh,
        WRITE_POS=slot_positions is not None, K=PASS_K, BP=pp, BN=pn,
    )  # fmt: skip
    y = torch.empty(t, nh, p, dtype=x.dtype, device=x.device)
    d, has_d, d_h, d_p = d_args(D, nh, A)
    _output_kernel[(nc, nh, triton.cdiv(p, bp))](
        x, dt, A, B, C, d, bias, y, contrib, ix.chunk_tok0, ix.chunk_len, ix.chunk_seg0, ix.chunk_valid,
        *x.stride(), y.stride(0), y.stride(1), *dt.stride(), *B.stride(), *C.stride(), d_h, d_p,
        p, n, nh, nh // g, lo, hi, **dt_kw, HAS_D=has_d, BQ=max(16, triton.next_power_of_2(ix.max_len)), BP=bp,
        BN=bn, BK=min(bn, 64), PREC=prec,
    )  # fmt: skip
    return y
