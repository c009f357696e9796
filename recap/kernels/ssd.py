"""Mamba2 SSD (arXiv 2405.21060, section 6: the chunked "state space dual" algorithm) over packed rows.

Glossary (code name: paper symbol)
- x [T, H, P]: X, H heads of head dim P; dt [T, H]: Delta (after bias, softplus, clamp to dt_limit).
- A [H]: the scalar a per head (negative); dA = Delta * A: log of the per-token decay.
- B, C [T, G, N]: B_t, C_t per group; head h reads group h // (H // G). D [H]: the skip.
- h [.., H, P, N]: the state; ssm_state [S, H, P, N] holds one per slot.
- recurrence: h_t = exp(dA_t) h_{t-1} + Delta_t x_t B_t^T;  y_t = h_t C_t + D x_t.
- chunk: a run of one row's tokens inside one cell of the chunk grid, at most SUB_CHUNK long; padded here
  to Q, the longest chunk of the step. Checkpoint positions do not cut chunks here (see
  kernels/tiling.py: these are its SSD chunks).
- segment: a chunk cut further at the checkpoint positions inside it; steps 2-3 work per segment, so
  every checkpoint state is a segment end state (DESIGN invariant 3). Without checkpoints, segment = chunk.
- segsum[i, j] = dA_{j+1} + .. + dA_i (i >= j), -inf above the diagonal; L = exp(segsum).

Algorithm (section 6, numbered as in the paper's listing):
1. intra-chunk outputs (diagonal blocks): Y_diag = (C B^T * L) (Delta x), a masked attention per chunk.
2. segment states: the state each segment adds, decayed to the segment end (right factor of the low-rank
   blocks); one GEMM over the segment's tokens, so cutting chunks into segments costs no extra flops.
3. inter-segment recurrence: h[k+1] = exp(sum of dA over segment k) h[k] + states[k], per row, starting
   from the slot state; a loop over chunk index vectorized across rows, or (with segments) one segment at a
   time, each segment's state computed straight into its checkpoint slot (_segment_states).
4. state -> output (left factor): Y_off = exp(cumsum dA) * (C h_start).
Padded positions get Delta = 0 (decay 1, no input), so every chunk's end state is exact.

CPU choices (T=2048, H=24, P=64, N=128, one thread: ~100 -> ~55-65 ms of CPU time per layer):
- segsum as a difference of fp64 cumsums (no cancellation at fp32; no (q, q) masked cumsum);
- exp clamped at EXP_MIN: producing fp32 subnormals makes exp ~5x slower, and such weights are < 2e-38;
- step 1 factorized where a chunk's decay allows (see _intra_chunk): one GEMM per chunk over all heads;
- token-major (c, q, h, p) intermediates, so the GEMMs read transposed views instead of copies, and
  equal-length chunks are plain views of the packed tokens (no gather, no scatter);
- checkpoints inside chunks (one at every 16-token block): 64-token chunks for steps 1 and 4 and 16-token
  segments for steps 2-3, instead of 16-token chunks throughout: 3.1x -> ~1.15-1.2x the time without
  checkpoints (T=2048, H=16, P=N=64), what is left mostly the 128 state writes (32 MiB) themselves.
Decode batches (one token per row) go to ssd_decode.ssd_state_update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.ssd_decode import d_skip, ssd_state_update
from recap.kernels.tiling import SegmentPlan
from recap.kernels.varlen import (
    chunk_view,
    copy_decode_checkpoints,
    copy_rows_to_slots,
    pad_tokens,
    process_dt,
    read_initial,
    write_slots,
    zero_pad_tokens,
)

NO_LIMIT = (0.0, float("inf"))
# Chunk-grid cells are cut into runs of at most SUB_CHUNK tokens (the math is the same at any
# cut): the quadratic intra-chunk part costs O(Q) per token, the state passing O(P N / Q) per token.
SUB_CHUNK = 64


def segsum(x: torch.Tensor) -> torch.Tensor:
    """(..., q) -> (..., q, q): sum_{k=j+1..i} x_k below the diagonal, -inf above.

    Summed directly (a masked cumsum), not as a difference of cumsums, which would cancel badly.
    """
    q = x.shape[-1]
    strict = torch.ones(q, q, dtype=torch.bool, device=x.device).tril(-1)
    xe = x[..., None, :].expand(*x.shape, q).transpose(-1, -2)  # [..., i, j] = x_i
    seg = xe.masked_fill(~strict, 0.0).cumsum(-2)
    return seg.masked_fill(~strict.logical_or(torch.eye(q, dtype=torch.bool, device=x.device)), -torch.inf)


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
    if meta.is_decode:
        y = ssd_state_update(
            ssm_state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, meta.state_indices,
            slot_positions, meta.chunk_end_positions - 1, meta.has_initial_state,
        )  # fmt: skip
        copy_decode_checkpoints(ssm_state, meta, slot_positions)
        return y
    t, nh, p = x.shape
    g, n = B.shape[1:]
    plan = meta.segment_plan(sub_chunk)
    cu, first, counts = (torch.tensor(v, device=meta.state_indices.device) for v in (plan.cu, plan.first, plan.counts))
    lens = cu.diff().tolist()
    q = max(lens)
    full = all(ln == q for ln in lens)  # every chunk exactly q long: the (c, q) layout is a view of the tokens
    idx, mask = chunk_view(cu, q)  # (c, q)
    nc = idx.shape[0]
    flat = idx.flatten()

    def chunked(v: torch.Tensor) -> torch.Tensor:  # (t, ...) -> (c, q, ...), positions past a chunk end: token 0
        return v.view(nc, q, *v.shape[1:]) if full else v.index_select(0, flat).view(nc, q, *v.shape[1:])

    delta = chunked(process_dt(dt, dt_bias, dt_softplus, dt_limit))  # (c, q, h)
    if not full:
        delta = delta * mask[..., None]  # padded positions: Delta = 0 (decay 1, no input)
    bc, cc = chunked(B).float(), chunked(C).float()  # (c, q, g, n)
    dx = chunked(x).float() * delta[..., None]  # (c, q, h, p): Delta_j x_j, token-major
    dA = (delta * A.float()).transpose(1, 2)  # (c, h, q)
    cs = dA.double().cumsum(-1)  # (c, h, q): dA_1 + .. + dA_i, in fp64 so that differences are exact in fp32

    # 1. intra-chunk: Y_diag[i] = sum_j (C_i . B_j) L[i, j] Delta_j x_j
    y = _intra_chunk(cs, cc, bc, dx)  # (c, q, h, p)

    # 2-3. states: sum_j exp(dA_{j+1} + .. + dA_end) Delta_j x_j B_j^T per chunk (or segment), then the
    # recurrence from each row's slot state; states[c] becomes the state after chunk c
    h0 = read_initial(ssm_state, meta.state_indices, meta.has_initial_state)  # (b, h, p, n)
    if plan.split:
        states = _segment_states(dx, bc, cs, h0, meta.has_initial_state_list, ssm_state, plan, slot_positions)
    else:
        decay_to_end = _exp((cs[..., -1:] - cs).float())  # (c, h, q)
        wx = dx.mul_(decay_to_end.transpose(1, 2)[..., None])  # (c, q, h, p), in place: dx is not needed again
        states = _outer_sum(wx, bc)  # (c, h, p, n)
        chunk_decay = _exp(cs[..., -1].float())[..., None, None]  # (c, h, 1, 1)
        _carry_states(h0, chunk_decay, states, first, counts)  # (c, h, p, n)
        copy_rows_to_slots(ssm_state, states, plan.checkpoints, slot_positions)  # segment = chunk here
    copy_rows_to_slots(ssm_state, states, plan.running, slot_positions)  # after the checkpoints, as in ssd_ref

    # 4. state -> output: Y_off[i] = exp(dA_1 + .. + dA_i) C_i . h_start, token-major, plus Y_diag
    y_tok = _state_readout(cc, states, h0, first)  # (c, q, h, p)
    y_tok.mul_(_exp(cs.float()).transpose(1, 2)[..., None]).add_(y)
    y_tok = y_tok.view(nc * q, nh, p)
    out = y_tok if full else y_tok.index_select(0, _token_slots(cu, q, t))  # (t, h, p)
    if D is not None:
        out.addcmul_(x.float(), D.float().reshape(nh, -1))
    zero_pad_tokens(out, meta)
    return out.to(x.dtype)


# exp is fast only for results in the normal fp32 range: measured per 3M elements, 3.4 ms in [-87, 80]
# but 140 ms for subnormal results, 48 ms for underflow to 0 and 42 ms at or past overflow. So inputs are
# clamped to [EXP_MIN, EXP_MAX]: a decay below exp(-87) ~ 1.6e-38 is taken as that (it is negligible next
# to any term it is added to), and values above EXP_MAX occur only above the diagonal of L (masked).
EXP_MIN, EXP_MAX = -87.0, 80.0
FACTOR_SPAN = 100.0  # largest chunk decay (in log units) taken by the factorized intra-chunk form


def _exp(v: torch.Tensor) -> torch.Tensor:
    """exp of a fresh fp32 tensor, in place, clamped to [EXP_MIN, EXP_MAX]."""
    return v.clamp_(EXP_MIN, EXP_MAX).exp_()


def _intra_chunk(cs: torch.Tensor, cc: torch.Tensor, bc: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Y_diag (c, q, h, p) = (L * C B^T) (Delta x) per chunk, L[i, j] = exp(cs_i - cs_j) for i >= j, else 0.

    cs (c, h, q) fp64 cumsum of dA; cc, bc (c, q, g, n); dx (c, q, h, p). Token-major output.
    Where a chunk's total decay (its span, cs_first - cs_last) is at most FACTOR_SPAN, L factorizes as
    exp(cs_i - m) exp(m - cs_j) with m the chunk's mid value, both factors within exp(+-FACTOR_SPAN / 2):
    then Y_diag = u * ((C B^T, causal) @ (v * Delta x)), one GEMM per chunk and group over all its heads,
    with no per-head (q, q) matrix. Chunk-heads that decay more take the exact per-head form.
    """
    nc, nh, q = cs.shape
    g = cc.shape[2]
    p = dx.shape[-1]
    cb = torch.matmul(cc.transpose(1, 2), bc.permute(0, 2, 3, 1))  # (c, g, q, q): C_i . B_j
    cb.masked_fill_(~torch.ones(q, q, dtype=torch.bool, device=cs.device).tril_(), 0.0)  # causal
    steep = (cs[..., 0] - cs[..., -1]) > FACTOR_SPAN  # (c, h)
    n_steep = int(steep.sum())
    if n_steep > steep.numel() // 2:  # mostly steep: the exact form for every head, without gathers
        scores = _exp_segsum(cs).view(nc, g, nh // g, q, q).mul_(cb[:, :, None]).view(nc, nh, q, q)
        return torch.matmul(scores, dx.transpose(1, 2)).transpose(1, 2)  # (c, q, h, p), a view
    mid = (cs[..., :1] + cs[..., -1:]) / 2  # (c, h, 1)
    u = _exp((cs - mid).float()).masked_fill_(steep[..., None], 0.0).transpose(1, 2)  # (c, q, h)
    v = _exp((mid - cs).float()).masked_fill_(steep[..., None], 0.0).transpose(1, 2)
    dxv = (dx * v[..., None]).view(nc, q, g, nh // g * p).transpose(1, 2)  # (c, g, q, r p)
    y = torch.matmul(cb, dxv).transpose(1, 2).reshape(nc, q, nh, p).mul_(u[..., None])  # (c, q, h, p)
    if n_steep:
        ci, hi = steep.nonzero(as_tuple=True)  # (k,), (k,)
        scores = _exp_segsum(cs[ci, hi]).mul_(cb[ci, hi // (nh // g)])  # (k, q, q)
        y[ci, :, hi] = torch.matmul(scores, dx[ci, :, hi])  # (k, q, p)
    return y


def _exp_segsum(cs: torch.Tensor) -> torch.Tensor:
    """L = exp(segsum) (..., q, q) in fp32 from fp64 cumsums cs (..., q); above the diagonal: finite junk."""
    seg = torch.empty(*cs.shape, cs.shape[-1], dtype=torch.float32, device=cs.device)
    torch.sub(cs[..., :, None], cs[..., None, :], out=seg)  # exact in fp32: the difference is taken in fp64
    return _exp(seg)


def _outer_sum(wx: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    """states (c, h, p, n) = sum_j wx_j B_j^T per chunk; wx (c, q, h, p), bc (c, q, g, n)."""
    nc, q, nh, p = wx.shape
    g, n = bc.shape[2:]
    if g == 1:  # one GEMM per chunk: (h p, q) @ (q, n), the left side a transposed view
        return torch.matmul(wx.view(nc, q, nh * p).transpose(1, 2), bc.view(nc, q, n)).view(nc, nh, p, n)
    wxg = wx.view(nc, q, g, nh // g * p)
    return torch.einsum("cqgm,cqgn->cgmn", wxg, bc).reshape(nc, nh, p, n)


def _segment_states(
    dx: torch.Tensor,
    bc: torch.Tensor,
    cs: torch.Tensor,
    h0: torch.Tensor,
    has_initial: list[bool],
    ssm_state: torch.Tensor,
    plan: SegmentPlan,
    slot_positions: torch.Tensor | None,
) -> torch.Tensor:
    """Steps 2-3 per segment when checkpoints fall inside chunks; writes every checkpoint slot, returns the
    state after each chunk (c, h, p, n).

    dx (c, q, h, p) is consumed; bc (c, q, g, n); cs (c, h, q) the fp64 cumsum of dA per chunk; h0 (b, h, p, n).
    Segment by segment: its state contribution as one GEMM over its own tokens (the flops of the unsplit
    case), written straight into its storage (a checkpoint's slot in an fp32 cache, else the chunk-end
    buffer), then h = exp(sum of dA over the segment) h_prev + contribution in place. So a checkpoint costs
    one write of its state, and no (segments, h, p, n) tensor exists: at 128 segments of 256 KiB it would be
    32 MiB, which glibc maps fresh on every call (~13 ms of page faults per layer, measured).
    """
    nc, nh, q = cs.shape
    g, n = bc.shape[2:]
    p = dx.shape[-1]
    dev = cs.device
    # each position's segment end (its last token): exp(cs_last - cs_i) decays token i to its segment end;
    # positions past a chunk's end keep q - 1 (cs is flat there, Delta = 0: they add nothing)
    last = [q - 1] * (nc * q)
    for c, a, b in plan.segments:
        last[c * q + a : c * q + b] = [b - 1] * (b - a)
    last_t = torch.tensor(last, dtype=torch.int64, device=dev).view(nc, 1, q)
    cs_last = cs.gather(-1, last_t.expand(nc, nh, q))
    wx = dx.mul_(_exp((cs_last - cs).float()).transpose(1, 2)[..., None])  # (c, q, h, p), in place
    cs0 = F.pad(cs, (1, 0)).transpose(1, 2).reshape(nc * (q + 1), nh)  # [chunk * (q+1) + k]: dA_1 + .. + dA_k
    chunk, start, end = torch.tensor(plan.segments, dtype=torch.int64, device=dev).unbind(1)  # (s,) each
    decay = _exp((cs0[chunk * (q + 1) + end] - cs0[chunk * (q + 1) + start]).float())  # (s, h)

    ends = torch.empty(nc, nh, p, n, dtype=torch.float32, device=dev)
    chunk_of = {s: c for c, s in enumerate(plan.chunk_last_seg)}
    inner = [w for w in plan.checkpoints if w[0] not in chunk_of]  # checkpoints inside chunks
    # in the cache itself where a slot holds exactly one fp32 state of this step (the carry reads it back)
    in_place = ssm_state.dtype == torch.float32 and ssm_state.is_contiguous()
    in_place = in_place and len({d for _, d, _ in inner}) == len(inner)
    stage = None if in_place else torch.empty(len(inner), nh, p, n, dtype=torch.float32, device=dev)
    store = {s: ssm_state[d] if stage is None else stage[i] for i, (s, d, _) in enumerate(inner)}
    store.update((s, ends[c]) for s, c in chunk_of.items())
    wx_t, b_t = wx.view(nc * q, g, nh // g * p), bc.reshape(nc * q, g, n)
    decays = decay[..., None, None].unbind(0)  # (h, 1, 1) per segment
    for s, ((c, a, b), row) in enumerate(zip(plan.segments, plan.seg_rows)):
        out = store[s]
        r0, r1 = c * q + a, c * q + b
        if g == 1:  # (h p, L) @ (L, n), the left side a transposed view
            torch.mm(wx_t[r0:r1, 0].T, b_t[r0:r1, 0], out=out.view(nh * p, n))
        else:
            torch.bmm(wx_t[r0:r1].permute(1, 2, 0), b_t[r0:r1].transpose(0, 1), out=out.view(g, nh // g * p, n))
        if s > 0 and plan.seg_rows[s - 1] == row:
            out.addcmul_(decays[s], store[s - 1])
        elif has_initial[row]:
            out.addcmul_(decays[s], h0[row])
    if inner:
        dst = torch.tensor([d for _, d, _ in inner], device=dev)
        pos = torch.tensor([w[2] for w in inner], device=dev)
        if stage is not None:
            write_slots(ssm_state, dst, stage, slot_positions, pos)
        elif slot_positions is not None:  # the states are in their slots already
            slot_positions.index_copy_(0, dst, pos.to(slot_positions.dtype))
    at_ends = [(chunk_of[s], d, p_) for s, d, p_ in plan.checkpoints if s in chunk_of]
    copy_rows_to_slots(ssm_state, ends, at_ends, slot_positions)
    return ends


def _state_readout(cc: torch.Tensor, h_after: torch.Tensor, h0: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(c, q, h, p) = C_i . h_start per chunk; cc (c, q, g, n), h_after (c, h, p, n) the state after each chunk.

    Chunk c starts from h_after[c - 1], except a row's first chunk, which starts from that row's h0 (b, h, p, n):
    one batched GEMM over the shifted states, then the first chunks again from h0.
    """
    nc, q, g, n = cc.shape
    nh, p = h_after.shape[1:3]
    y = torch.empty(nc, q, nh, p, dtype=torch.float32, device=cc.device)
    _readout_into(y[1:], cc[1:], h_after[:-1])
    if first.numel() == 1:  # one row: only chunk 0 starts from h0
        _readout_into(y[:1], cc[:1], h0)
    else:
        start = torch.empty(first.numel(), q, nh, p, dtype=torch.float32, device=cc.device)
        _readout_into(start, cc[first], h0)
        y[first] = start
    return y


def _readout_into(out: torch.Tensor, cc: torch.Tensor, hs: torch.Tensor) -> None:
    """out (k, q, h, p) = C_i . hs per chunk; cc (k, q, g, n), hs (k, h, p, n). out is contiguous."""
    k, q, g, n = cc.shape
    nh, p = hs.shape[1:3]
    if k == 0:
        return
    if g == 1:  # one GEMM per chunk: (q, n) @ (n, h p)
        torch.matmul(cc.view(k, q, n), hs.reshape(k, nh * p, n).transpose(1, 2), out=out.view(k, q, nh * p))
    else:
        out.copy_(torch.einsum("cqgn,cgmn->cqgm", cc, hs.reshape(k, g, nh // g * p, n)).reshape(k, q, nh, p))


def _token_slots(cu: torch.Tensor, q: int, t: int) -> torch.Tensor:
    """[T]: each token's row in the (c * q) padded layout (chunk c holds tokens cu[c]..cu[c+1])."""
    lens = cu.diff()
    chunk = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=t)
    return torch.arange(t, device=cu.device) + chunk * q - cu[chunk]


def _carry_states(
    h0: torch.Tensor, chunk_decay: torch.Tensor, states: torch.Tensor, first: torch.Tensor, counts: torch.Tensor
) -> None:
    """In place: states[c] += decay[c] * (state after the previous chunk of the row, or the row's h0).

    Afterwards states[c] is the state after chunk c. One chunk index at a time, vectorized across rows;
    views (no gather) while a single row is left, as in a long prefill.
    """
    first_l, counts_l = first.tolist(), counts.tolist()
    for k in range(max(counts_l)):
        rows = [r for r, cnt in enumerate(counts_l) if cnt > k]
        if len(rows) == 1:
            c = first_l[rows[0]] + k
            states[c].addcmul_(chunk_decay[c], h0[rows[0]] if k == 0 else states[c - 1])
            continue
        rows_t = torch.tensor(rows, device=states.device)
        cid = first[rows_t] + k
        prev = h0[rows_t] if k == 0 else states[cid - 1]
        states[cid] = torch.addcmul(states[cid], chunk_decay[cid], prev)


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
    """Sequential per-token reference of ssd (same signature and side effects)."""
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
    y = y + d_skip(D, x.float())
    return y.masked_fill_(pad_tokens(meta, t)[:, None, None], 0.0).to(x.dtype)
