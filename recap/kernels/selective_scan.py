"""Mamba1 selective scan (arXiv 2312.00752, Algorithm 2) over packed rows, with per-slot SSM states.

Glossary (code name: paper symbol)
- u [T, I]: x, the scan input (I = d_inner channels); delta [T, I]: Delta, after bias and softplus.
- A [I, N]: A (diagonal, negative); B, C [T, N]: B_t, C_t, shared by all channels; D [I]: the skip.
- h [.., I, N]: the hidden state; ssm_state [S, I, N] holds one per slot.
- recurrence: h_t = exp(Delta_t A) * h_{t-1} + Delta_t B_t u_t;  y_t = C_t . h_t + D u_t, times silu(z_t).
- block: a run of <= BLOCK tokens of one row inside one metadata chunk (a piece, kernels/tiling.py); the
  parallel scan works per block.

Parallel form: inside a block, with the log-space cumulative sum c_t = A (Delta_1 + .. + Delta_t),
    h_t = exp(c_t) * (h_0 + sum_{s<=t} exp(-c_s) Delta_s B_s u_s),
one exp per element, and the sum over s as a lower-triangular GEMM. It is exact while |c_t| stays far
from the fp32 exp range (LOG_RANGE); a block that spans more decay is cut in halves (the state carried
across), and below MIN_SPLIT tokens takes a log-depth (Hillis-Steele) scan, which is always stable.
Blocks go one block index at a time, vectorized over rows; the state is carried from step to step.

Measured (T=2048, I=1536, N=16, one thread, CPU time on a shared machine): this form at block 16
~220 ms, ~170-180 ms since h_0 is folded into the GEMM and the skip/gate run in place (blocks of 8, 32
and 64: ~190, ~255, ~290 ms); the same with aten::cumsum over t (slow on a middle dim) ~630 ms; a
log-depth scan at block 16 ~310 ms; a Python loop over tokens (not allowed for prefill) ~140 ms. exp
alone is ~60 ms of it. A two-level pass (all blocks at once from zero, then one carry pass) would save
the per-block Python calls (~20 ms) but add a correction pass over (T, I, N) (~20 ms): estimated from
those op costs, not built.
Decode batches go to selective_state_update (in place on each slot, row by row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.tiling import Piece, cut_pieces
from recap.kernels.varlen import (
    copy_decode_checkpoints,
    decode_rows,
    pad_tokens,
    process_dt,
    read_initial,
    record_decode_positions,
    write_ssm_states,
)

BLOCK = 16
LOG_RANGE = 60.0  # bound on |c_t| for the log-space form: exp(60) * |dBu| * BLOCK stays finite in fp32
MIN_SPLIT = 8  # below this a block that still spans too much decay takes the log-depth scan
STEP_TOKENS = 64  # tokens per vectorized pass (rows * block): bounds the (r, l, i, n) temporaries


def _log_depth_scan(dec: torch.Tensor, bx: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """Hillis-Steele scan of h_t = dec_t h_{t-1} + bx_t: combine pairs at distance 1, 2, 4, ... Always stable."""
    hs = bx.clone()
    hs[:, 0] += dec[:, 0] * h0
    k = 1
    while k < dec.shape[1]:
        hs[:, k:] = hs[:, k:] + dec[:, k:] * hs[:, :-k]
        dec[:, k:] = dec[:, k:] * dec[:, :-k]
        k *= 2
    return hs


def scan_block(dl: torch.Tensor, A: torch.Tensor, bx: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """States after each position of h_t = exp(Delta_t A) h_{t-1} + bx_t (bx is consumed).

    dl: Delta (r, l, i); A: (i, n); bx: (r, l, i, n); h0: (r, i, n). Uses the log-space form when the
    block's decay range allows it, otherwise splits the block in halves (the state carried across), and
    below MIN_SPLIT tokens takes the log-depth scan.
    """
    r, length, i = dl.shape
    n = A.shape[1]
    cd = dl.cumsum(1)  # (r, l, i): c_t = A * cd_t, since A does not depend on t
    if float(cd.abs().amax()) * float(A.abs().amax()) < LOG_RANGE:
        e = torch.exp_(cd[..., None] * -A)  # (r, l, i, n): exp(-c_t)
        # h_0 + cumsum over t, as one lower-triangular GEMM: far faster than aten::cumsum on a middle dim.
        # h_0 is folded into the first term (every partial sum includes it): no broadcast copy of h_0.
        tril = torch.ones(length, length, device=dl.device).tril_().expand(r, length, length)
        w = bx.mul_(e)
        w[:, 0] += h0
        acc = torch.bmm(tril, w.view(r, length, i * n)).view(r, length, i, n)
        return acc.div_(e)  # exp(c_t) * (h_0 + sum_{s<=t} exp(-c_s) bx_s)
    if length <= MIN_SPLIT:
        return _log_depth_scan(torch.exp(dl[..., None] * A), bx, h0)
    half = length // 2
    first = scan_block(dl[:, :half], A, bx[:, :half], h0)
    second = scan_block(dl[:, half:], A, bx[:, half:], first[:, -1])
    return torch.cat([first, second], dim=1)


def _block_steps(meta: SSMMetadata, block: int) -> list[list[Piece]]:
    """Per step, the blocks (tiling pieces of `block` tokens; chunk -1 unless the block ends its chunk) to scan
    together.

    Step j holds the j-th block of every valid row (cut in groups of at most STEP_TOKENS tokens); a row's
    blocks come in order, so its state is carried from one step to the next.
    """
    per_row: dict[int, list[Piece]] = {}
    for b in cut_pieces(meta.chunks, block):
        if meta.state_indices_list[b.row] != PAD_SLOT_ID:
            per_row.setdefault(b.row, []).append(b)
    depth = max((len(b) for b in per_row.values()), default=0)
    group = max(1, STEP_TOKENS // block)
    steps = [[b[j] for b in per_row.values() if j < len(b)] for j in range(depth)]
    return [step[k : k + group] for step in steps for k in range(0, len(step), group)]


def _step_view(
    step: list[Piece], dev: torch.device
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], None]]:
    """take: per-token [T, ...] -> (r, l, ...) with zeros past each block's end; put: write (r, l, ...) back."""
    if len(step) == 1:  # one block: plain slices, no gather
        _, s, e, _ = step[0]
        return (lambda x: x[s:e][None]), (lambda out, val: out[s:e].copy_(val[0]))
    starts = torch.tensor([b[1] for b in step], device=dev)
    lens = torch.tensor([b[2] - b[1] for b in step], device=dev)
    ar = torch.arange(int(lens.max()), device=dev)
    mask = ar < lens[:, None]  # (r, l)
    idx = (starts[:, None] + ar).masked_fill(~mask, 0)  # (r, l) token index
    flat = idx[mask]

    def take(x: torch.Tensor) -> torch.Tensor:
        return x[idx].masked_fill_(~mask.view(*mask.shape, *([1] * (x.dim() - 1))), 0.0)

    def put(out: torch.Tensor, val: torch.Tensor) -> None:
        out[flat] = val[mask]

    return take, put


def _skip_and_gate(y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """(y + D u) * silu(z), in place on y (a fresh fp32 tensor)."""
    if D is not None:
        y.addcmul_(u.float(), D.float())
    if z is not None:
        y.mul_(F.silu(z.float()))
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
    """Selective scan of every row from its slot state; writes running and checkpoint slots. PAD rows: zeros."""
    if meta.is_decode:
        return _decode(u, delta, A, B, C, D, z, delta_bias, delta_softplus, ssm_state, meta, slot_positions)
    t, i = u.shape
    n = A.shape[1]
    dev = u.device
    dt = process_dt(delta, delta_bias, delta_softplus)  # (t, i)
    du = dt * u.float()  # (t, i)
    Af, Bf, Cf = A.float(), B.float(), C.float()
    h = read_initial(ssm_state, meta.state_indices, meta.has_initial_state)  # (b, i, n)
    ends = torch.zeros(len(meta.chunk_seq_idx_list), i, n, dtype=torch.float32, device=dev)  # (c, i, n)
    has_pad = PAD_SLOT_ID in meta.state_indices_list
    y = (torch.zeros if has_pad else torch.empty)(t, i, dtype=torch.float32, device=dev)  # blocks cover valid rows
    for step in _block_steps(meta, block):
        take, put = _step_view(step, dev)
        # Padded positions get Delta = 0 (take zeroes them): decay 1 and no input, so the block's last
        # state is the state at the block's real end.
        dl, dx, bt, ct = take(dt), take(du), take(Bf), take(Cf)  # (r, l, i), (r, l, i), (r, l, n), (r, l, n)
        if len(step) == 1:  # one block (a long row): the row's state as a view, no gather or scatter
            rows, h_in = step[0][0], h[step[0][0]][None]
        else:
            rows = torch.tensor([b[0] for b in step], device=dev)
            h_in = h[rows]
        hs = scan_block(dl, Af, dx[..., None] * bt[:, :, None, :], h_in)  # (r, l, i, n)
        put(y, torch.einsum("rlin,rln->rli", hs, ct))  # y_t = C_t . h_t
        h[rows] = hs[:, -1] if len(step) > 1 else hs[0, -1]
        for k, b in enumerate(step):
            if b[3] >= 0:  # the block ends a chunk: its state is that chunk's end state
                ends[b[3]] = hs[k, -1]
    write_ssm_states(ssm_state, ends, meta, slot_positions)
    y = _skip_and_gate(y, u, D, z)
    if has_pad:
        y.masked_fill_(pad_tokens(meta, t)[:, None], 0.0)
    return y.to(u.dtype)


def _decode(
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
    slot_positions: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row (one chunk per row): the update kernel, then checkpoint copies of the new state."""
    y = selective_state_update(
        ssm_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, meta.state_indices,
        slot_positions, meta.chunk_end_positions - 1, meta.has_initial_state,
    )  # fmt: skip
    copy_decode_checkpoints(ssm_state, meta, slot_positions)
    return y


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

    positions ([B], the token's absolute position as in ForwardBatch.positions) is required with
    slot_positions, which records positions + 1 (tokens folded into the state) for every slot written.
    has_initial_state (optional [B] bool): rows marked False start from a zero state instead of the slot.
    Running slots must be distinct. Reference: selective_state_update_ref.

    Fast path: in place on each slot's memory, row by row (an fp32 cache; other dtypes through an fp32
    copy); y = h C as one mat-vec per row. No gather or scatter of the [B, I, N] states.
    """
    b, i = x.shape
    y = torch.zeros(b, i, dtype=torch.float32, device=x.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        d = process_dt(dt, dt_bias, dt_softplus)  # (b, i)
        decay = torch.exp(d[..., None] * A.float()).unbind(0)  # (i, n) per row
        dx = (d * x.float())[..., None].unbind(0)  # (i, 1) per row: Delta x
        bf, cf, yr = B.float()[:, None, :].unbind(0), C.float().unbind(0), y.unbind(0)  # (1, n), (n,), (i,)
        in_place = state.dtype == torch.float32 and state.is_contiguous()
        for r, slot, init in rows:
            h = state[slot] if in_place else state[slot].float()  # (i, n)
            if not init:
                h.zero_()
            h.mul_(decay[r]).addcmul_(dx[r], bf[r])
            torch.mv(h, cf[r], out=yr[r])  # y = h C
            if not in_place:
                state[slot] = h.to(state.dtype)
        y = _skip_and_gate(y, x, D, z)
        if len(rows) < b:
            y.masked_fill_((state_indices == PAD_SLOT_ID)[:, None], 0.0)
    record_decode_positions(slot_positions, state_indices, positions)
    return y.to(x.dtype)


def selective_state_update_ref(
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
    """Plain per-row reference of selective_state_update (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        h = torch.zeros(state.shape[1:], device=x.device)
        if has_initial_state is None or bool(has_initial_state[row]):
            h = state[slot].float()
        d = process_dt(dt[row], dt_bias, dt_softplus)  # (i,)
        h = torch.exp(d[:, None] * A.float()) * h + (d * x[row].float())[:, None] * B[row].float()
        y = _skip_and_gate(h @ C[row].float(), x[row], D, None if z is None else z[row])
        out[row] = y.to(x.dtype)
        state[slot] = h.to(state.dtype)
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
    return out


def selective_scan_ref(
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
) -> torch.Tensor:
    """Sequential per-token reference of selective_scan (same signature and side effects)."""
    t, i = u.shape
    dt = process_dt(delta, delta_bias, delta_softplus)
    Af = A.float()
    y = torch.zeros(t, i, dtype=torch.float32, device=u.device)
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        h = torch.zeros(i, A.shape[1], device=u.device)
        if meta.has_initial_state_list[row]:
            h = ssm_state[slot].float()
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            h = torch.exp(dt[tok, :, None] * Af) * h + (dt[tok] * u[tok].float())[:, None] * B[tok].float()
            y[tok] = h @ C[tok].float()
            c = chunk_end.get(tok + 1)
            if c is not None and meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                ssm_state[meta.chunk_dest_slots_list[c]] = h.to(ssm_state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        ssm_state[slot] = h.to(ssm_state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = meta.chunk_end_positions_list[meta.last_chunk_indices[row]]
    return _skip_and_gate(y, u, D, z).masked_fill_(pad_tokens(meta, t)[:, None], 0.0).to(u.dtype)
