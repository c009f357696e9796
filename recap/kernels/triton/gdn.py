"""Triton kernels for the gated delta rule over packed rows (GPU twins of recap/kernels/gdn.py and
gdn_decode.py; glossary and recurrence there). One kernel serves Gated DeltaNet (a decay per head, g [T, Hv])
and KDA (a decay per key channel, g [T, Hv, Dk]: the PER_CHANNEL flag), in two forms (steps of
CHUNK_MIN_TOKENS tokens or more, GDN's and KDA's, go to the chunk-parallel form of triton/gdn_chunk.py instead):

- per token (piece 1): S = Diag(exp g) S;  S += k (beta (v - S^T k))^T;  o = S^T q, one token at a time. Used
  for decode batches and by gated_delta_rule_update.
- chunked (piece 16): every metadata chunk is cut into pieces of `piece` tokens, each computed in the WY / UT
  form of the GDN paper (arXiv 2412.06464, section 3.3), with cum = cumsum(g) inside the piece and
  L[i, j] = exp(cum_i - cum_j) for i >= j (per channel for KDA):
  1. M = strictly_lower((beta k) k^T * L), A = lower(q k^T * L); T = (I + M)^-1 (forward substitution);
     U = T (beta v), W = T (beta k exp(cum)).
  2. V' = U - W S;  o = (q exp(cum)) S + A V';  S = Diag(exp(cum_last)) S + (k exp(cum_last - cum))^T V'.
  Every exponent is <= 0 (differences are taken inside the piece, never as exp(cum_i) / exp(cum_j)), so
  strong decays underflow to 0 instead of overflowing.

One program per (row, value head, Dv tile) holds its [Dk, BV] fp32 state tile in registers and walks the row's
metadata chunks in order: the tile of the state at every chunk end with a destination slot is stored there,
the final one into the running slot (+ slot_positions by the (head 0, tile 0) program). Pieces never cross a
chunk end, so each checkpoint is the exact state after its position. Rows with a PAD_SLOT_ID running slot read
and write no slot and output zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from recap.kernels.metadata import SSMMetadata
from recap.kernels.triton.delta_parts import channel_gram, l2norm_rows, unit_lower_inverse, write_state_tile
from recap.kernels.triton.gdn_chunk import CHUNK, chunk_gated_delta_rule

PIECE = 16  # tokens per chunked piece (tl.dot needs >= 16)
BLOCK_V = 32  # Dv tile: Hv * Dv / 32 programs per row keeps an H100 busy on one long row
# A step of this many tokens or more runs the chunk-parallel form: at 8k tokens on an H100 the per-row walk of
# 16-token pieces took ~3.4 ms per Qwen3.5-like layer. The threshold itself is not measured yet
# (benchmarks/gpu_check.py's tune section times both forms).
CHUNK_MIN_TOKENS = 256


@dataclass(frozen=True)
class RowChunks:
    """Each row's running slot and its chunks (the SSMMetadata fields the kernel reads), as device tensors."""

    state_indices: torch.Tensor  # [B] running slot or PAD_SLOT_ID
    has_initial_state: torch.Tensor  # [B] bool
    cu_chunk_seqlens: torch.Tensor  # [C+1] token offsets
    last_chunk_indices: torch.Tensor  # [B] each row's last chunk; its first is the previous row's last + 1
    chunk_dest_slots: torch.Tensor  # [C] checkpoint slot or PAD_SLOT_ID
    chunk_end_positions: torch.Tensor  # [C] tokens folded in at the chunk end (the position recorded)
    num_rows: int

    @staticmethod
    def of(meta: SSMMetadata) -> RowChunks:
        return RowChunks(
            meta.state_indices, meta.has_initial_state, meta.cu_chunk_seqlens, meta.last_chunk_indices,
            meta.chunk_dest_slots, meta.chunk_end_positions, len(meta.state_indices_list),
        )  # fmt: skip

    @staticmethod
    def decode(
        state_indices: torch.Tensor, positions: torch.Tensor | None, has_initial_state: torch.Tensor | None
    ) -> RowChunks:
        """One token per row, one chunk per row, no checkpoint; the position recorded is positions + 1."""
        b, dev = state_indices.numel(), state_indices.device
        ar = torch.arange(b + 1, device=dev)
        init = torch.ones(b, dtype=torch.bool, device=dev) if has_initial_state is None else has_initial_state
        pos = torch.zeros(b, dtype=torch.int64, device=dev) if positions is None else positions + 1
        return RowChunks(state_indices, init, ar, ar[1:] - 1, torch.full_like(ar[1:], -1), pos, b)


@triton.jit
def _token_step(s, q, k, v, g, beta, PER_CHANNEL: tl.constexpr):
    """One token: s [BK, BV]; q, k [BK]; v [BV]; g [BK] or scalar; beta scalar -> (s, o [BV])."""
    decay = tl.exp(g)
    if PER_CHANNEL:
        decay = decay[:, None]  # one per row of s
    s = s * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _piece_step(s, q, k, v, g, beta, BT: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """One piece (module docstring, steps 1-2): s [BK, BV]; q, k [BT, BK]; v [BV]; g [BT] or [BT, BK];
    beta [BT]; positions past the piece hold zeros (no effect) -> (s, o [BT, BV])."""
    r = tl.arange(0, BT)
    cum = tl.cumsum(g, 0)
    last = tl.sum(g, 0)  # cum at the piece end: (BK,) or scalar
    kb = k * beta[:, None]
    if PER_CHANNEL:
        m, a = channel_gram(kb, k, cum, True, BT, PREC), channel_gram(q, k, cum, False, BT, PREC)
        dec = tl.exp(cum)  # (BT, BK)
        k_dec = k * tl.exp(last[None, :] - cum)
        s_dec = tl.exp(last)[:, None]
    else:
        lower = r[:, None] >= r[None, :]
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))  # L (BT, BT)
        m = tl.where(r[:, None] > r[None, :], tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        a = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        dec = tl.exp(cum)[:, None]
        k_dec = k * tl.exp(last - cum)[:, None]
        s_dec = tl.exp(last)
    t = unit_lower_inverse(m, BT)
    u = tl.dot(t, v * beta[:, None], input_precision=PREC)  # (BT, BV)
    w = tl.dot(t, kb * dec, input_precision=PREC)  # (BT, BK)
    v_new = u - tl.dot(w, s, input_precision=PREC)
    o = tl.dot(q * dec, s, input_precision=PREC) + tl.dot(a, v_new, input_precision=PREC)
    s = s * s_dec + tl.dot(tl.trans(k_dec), v_new, input_precision=PREC)
    return s, o


@triton.jit
def _advance(
    s, start, end, h, kh, valid, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sg_t, sg_h, sb_t, sb_h, ck, km, cv, vm, q_scale,
    BT: tl.constexpr, PER_CHANNEL: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Fold the tokens start .. min(start + BT, end) into s and store their outputs (zeros for pad rows)."""
    if BT > 1:
        tt = start + tl.arange(0, BT)
        tm = tt < end
        tc = tt[:, None]  # token axis against channels: (BT, 1)
        kmask, vmask = tm[:, None] & km, tm[:, None] & vm
    else:  # one token (the caller's loop keeps start < end)
        tt, tm, tc = start, start < end, start
        kmask, vmask = km, vm
    q = tl.load(q_ptr + tc * sq_t + kh * sq_h + ck, mask=kmask, other=0.0).to(tl.float32)
    q = l2norm_rows(q, NORM_QK, BT) * q_scale
    k = l2norm_rows(tl.load(k_ptr + tc * sk_t + kh * sk_h + ck, mask=kmask, other=0.0).to(tl.float32), NORM_QK, BT)
    v = tl.load(v_ptr + tc * sv_t + h * sv_h + cv, mask=vmask, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + tt * sb_t + h * sb_h, mask=tm, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        g = tl.load(g_ptr + tc * sg_t + h * sg_h + ck, mask=kmask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + tt * sg_t + h * sg_h, mask=tm, other=0.0).to(tl.float32)
    if BT > 1:
        s, o = _piece_step(s, q, k, v, g, beta, BT, PER_CHANNEL, PREC)
    else:
        s, o = _token_step(s, q, k, v, g, beta, PER_CHANNEL)
    o = tl.where(valid, o, 0.0)
    tl.store(o_ptr + tc * so_t + h * so_h + cv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    return s


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, state_ptr, sp_ptr,
    run_ptr, init_ptr, cu_ptr, last_ptr, dest_ptr, pos_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sg_t, sg_h, sb_t, sb_h, ss_s, ss_h, ss_k, ss_v,
    group, dk, dv, q_scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, NORM_QK: tl.constexpr,
    HAS_SP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One program per (row, value head, Dv tile): the row's chunks in order, pieces of BT tokens (1: per token)."""
    row, h, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    run = tl.load(run_ptr + row)
    valid = run >= 0
    init = (tl.load(init_ptr + row) != 0) & valid
    c0 = tl.load(last_ptr + row - 1, mask=row > 0, other=-1) + 1
    c1 = tl.load(last_ptr + row) + 1
    ck = tl.arange(0, BK)
    cv = vt * BV + tl.arange(0, BV)
    km, vm = ck < dk, cv < dv
    s_off = h * ss_h + ck[:, None] * ss_k + cv[None, :] * ss_v
    s_mask = km[:, None] & vm[None, :]
    base = tl.where(init, run, 0).to(tl.int64) * ss_s
    s = tl.load(state_ptr + base + s_off, mask=tl.where(init, s_mask, False), other=0.0).to(tl.float32)
    first = (h == 0) & (vt == 0)
    for c in range(c0, c1):
        end = tl.load(cu_ptr + c + 1)
        for start in range(tl.load(cu_ptr + c), end, BT):
            s = _advance(
                s, start, end, h, h // group, valid, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr,
                sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sg_t, sg_h, sb_t, sb_h, ck, km, cv, vm, q_scale,
                BT, PER_CHANNEL, NORM_QK, PREC,
            )  # fmt: skip
        dest = tl.load(dest_ptr + c)
        write_state_tile(state_ptr, sp_ptr, dest, tl.load(pos_ptr + c), s, ss_s, s_off, s_mask, first, HAS_SP)
    write_state_tile(state_ptr, sp_ptr, run, tl.load(pos_ptr + c1 - 1), s, ss_s, s_off, s_mask, first, HAS_SP)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: RowChunks,
    slot_positions: torch.Tensor | None,
    piece: int,
    norm_qk: bool,
) -> torch.Tensor:
    """Run the kernel over rows (pieces of `piece` tokens, 1: per token) -> o [T, Hv, Dv] in v's dtype.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] (per head) or [T, Hv, Dk] (per channel); beta [T, Hv];
    norm_qk: L2-normalise q and k in the kernel and scale q by Dk^-1/2 (KDA's input preparation).
    """
    t, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    if hv % hk or q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: value heads {hv} not a multiple of key heads")
    if piece != 1 and (piece < 16 or piece & (piece - 1)):
        raise ValueError(f"piece {piece}: 1 (per token) or a power of two >= 16")
    if slot_positions is not None and slot_positions.stride(0) != 1:
        raise ValueError("slot_positions must have a unit stride (the kernel writes slot_positions[slot])")
    per_channel = g.dim() == 3
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if per_channel and g.stride(-1) != 1:
        g = g.contiguous()
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    sp = rows.state_indices if slot_positions is None else slot_positions  # never written without HAS_SP
    bv = min(_pow2(dv), BLOCK_V)
    grid = (rows.num_rows, hv, triton.cdiv(dv, bv))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, out, state, sp, rows.state_indices, rows.has_initial_state, rows.cu_chunk_seqlens,
        rows.last_chunk_indices, rows.chunk_dest_slots, rows.chunk_end_positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), *state.stride(),
        hv // hk, dk, dv, dk**-0.5 if norm_qk else 1.0,
        BT=piece, BK=_pow2(dk), BV=bv, PER_CHANNEL=per_channel, NORM_QK=norm_qk, HAS_SP=slot_positions is not None,
        PREC="ieee" if v.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def run_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None,
    piece: int,
    norm_qk: bool,
) -> torch.Tensor:
    """A varlen step (GDN and KDA): pieces of `piece` tokens, decode batches per token."""
    return launch(q, k, v, g, beta, state, RowChunks.of(meta), slot_positions, 1 if meta.is_decode else piece, norm_qk)


def run_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None,
    positions: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    norm_qk: bool,
) -> torch.Tensor:
    """A decode update (GDN and KDA): one token per row, in place on the running slots."""
    if slot_positions is not None and positions is None:
        raise ValueError("slot_positions needs positions")
    rows = RowChunks.decode(state_indices, positions, has_initial_state)
    return launch(q, k, v, g, beta, state, rows, slot_positions, 1, norm_qk)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    piece: int = PIECE,
    normalize_qk: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """Gated delta rule of every row from its slot state (or zeros); writes checkpoint and running slots.

    q, k L2-normalised (q scaled by Dk^-1/2) by the caller, or here, as the kernel loads them, with
    `normalize_qk`; g the log decay, per head [T, Hv] or per key channel [T, Hv, Dk] (KDA). Returns o [T, Hv, Dv]
    in v's dtype, zeros for padding rows. Steps of CHUNK_MIN_TOKENS tokens or more (not decode batches) run the
    chunk-parallel form (triton/gdn_chunk.py) in chunks of `chunk` tokens (None: CHUNK); shorter ones this
    module's kernel in pieces of `piece` (1: per token). An explicit `chunk` runs the chunk form whatever the
    step. Reference: gated_delta_rule_ref.
    """
    if chunk is not None or (not meta.is_decode and v.shape[0] >= CHUNK_MIN_TOKENS):
        return chunk_gated_delta_rule(q, k, v, g, beta, state, meta, slot_positions, chunk or CHUNK, normalize_qk)
    return run_varlen(q, k, v, g, beta, state, meta, slot_positions, piece, normalize_qk)


def gated_delta_rule_update(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row [B, ...], state[slot] updated in place; PAD rows output zeros. slot_positions
    records positions + 1 (positions required with it). Reference: gated_delta_rule_update_ref."""
    return run_update(q, k, v, g, beta, state, state_indices, slot_positions, positions, has_initial_state, False)
