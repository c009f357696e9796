"""Triton depthwise causal conv1d over packed rows, with conv-window checkpoints (GPU twin of recap.kernels.conv1d).

Glossary (as in recap.kernels.conv1d)
- x: conv input [T, D]; weight [D, K]: tap k of channel d multiplies input t - (K-1) + k.
- conv_state [S, D, K-1]: a row's last K-1 inputs, oldest first; relative position p < 0 of a row reads
  column K-1+p of its running slot (zeros without initial state).
- window at a chunk end e: the K-1 inputs at relative positions e-(K-1) .. e-1.

Two launches: the conv outputs (one program per [BLOCK_T tokens, BLOCK_D channels] tile, tokens of any
rows), then the windows (one program per (row, channel tile), walking the row's chunks): a row's initial
window lives in its running slot, so the final window may only be written once every read of it is done.
Decode (causal_conv1d_update) is the same pair of kernels over one-token rows, one chunk each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import token_rows

BLOCK_T = 16  # tokens per output tile
PAD = tl.constexpr(PAD_SLOT_ID)  # a global read inside a kernel must be a constexpr


@triton.jit
def _inputs(x_ptr, stride_xt, stride_xd, start, p, d, s_ptr, slot, stride_ss, stride_sd, stride_sk, use_init, mask,
            K: tl.constexpr):  # fmt: skip
    """fp32 inputs at relative positions p of rows starting at token `start` (p < 0: the row's initial window).

    Scalar conditions join masks through tl.where: `tensor & scalar bool` yields int8 under the interpreter.
    """
    from_x = p >= 0
    xv = tl.load(x_ptr + (start + p) * stride_xt + d * stride_xd, mask=mask & from_x, other=0.0)
    s_off = slot * stride_ss + d * stride_sd + (K - 1 + p) * stride_sk
    sv = tl.load(s_ptr + s_off, mask=tl.where(use_init, mask & (p < 0), False), other=0.0)
    return tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _conv_out_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, rows_ptr, qsl_ptr, slots_ptr, init_ptr,
    T, D, stride_xt, stride_xd, stride_wd, stride_wk, stride_ss, stride_sd, stride_sk, stride_yt,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """y[t, d] = act(bias + sum_k w[d, k] * input(t - (K-1) + k)); tokens of PAD rows get 0."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # (bt, 1)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]  # (1, bd)
    mask_t, mask_d = t < T, d < D
    row = tl.load(rows_ptr + t, mask=mask_t, other=0)
    start = tl.load(qsl_ptr + row, mask=mask_t, other=0)
    slot = tl.load(slots_ptr + row, mask=mask_t, other=PAD)
    use_init = (tl.load(init_ptr + row, mask=mask_t, other=0) != 0) & (slot != PAD)
    rel = t - start
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        xv = _inputs(x_ptr, stride_xt, stride_xd, start, rel - (K - 1) + k, d, s_ptr, slot,
                     stride_ss, stride_sd, stride_sk, use_init, mask_t & mask_d, K)  # fmt: skip
        wk = tl.load(w_ptr + d * stride_wd + k * stride_wk, mask=mask_d, other=0.0).to(tl.float32)
        acc += xv * wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(slot == PAD, 0.0, acc)
    tl.store(y_ptr + t * stride_yt + d, acc.to(y_ptr.dtype.element_ty), mask=mask_t & mask_d)


@triton.jit
def _conv_windows_kernel(
    x_ptr, s_ptr, pos_ptr, qsl_ptr, slots_ptr, init_ptr, last_ptr, cu_ptr, dest_ptr, end_pos_ptr,
    D, stride_xt, stride_xd, stride_ss, stride_sd, stride_sk,
    K: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Window at every chunk end of a row into its dest slot, then the final window into the running slot."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]  # (bd, 1)
    j = tl.arange(0, BLOCK_W)[None, :]  # (1, bw): window column
    first_lane = (d + j) == 0  # one lane of the grid stores the position
    start = tl.load(qsl_ptr + row)
    slot = tl.load(slots_ptr + row)
    mask = tl.where(slot != PAD, (d < D) & (j < K - 1), False)  # PAD rows write nothing
    use_init = tl.load(init_ptr + row) != 0
    first = tl.load(last_ptr + row - 1, mask=row > 0, other=-1) + 1
    last = tl.load(last_ptr + row)
    for c in range(first, last + 1):
        dest = tl.load(dest_ptr + c)
        m = tl.where(dest != PAD, mask, False)
        e = tl.load(cu_ptr + c + 1) - start
        win = _inputs(x_ptr, stride_xt, stride_xd, start, e - (K - 1) + j, d, s_ptr, slot,
                      stride_ss, stride_sd, stride_sk, use_init, m, K)  # fmt: skip
        tl.store(s_ptr + dest * stride_ss + d * stride_sd + j * stride_sk, win.to(s_ptr.dtype.element_ty), mask=m)
        if HAS_POS:
            tl.store(pos_ptr + dest + 0 * (d + j), tl.load(end_pos_ptr + c), mask=m & first_lane)
    e = tl.load(cu_ptr + last + 1) - start
    win = _inputs(x_ptr, stride_xt, stride_xd, start, e - (K - 1) + j, d, s_ptr, slot,
                  stride_ss, stride_sd, stride_sk, use_init, mask, K)  # fmt: skip
    tl.debug_barrier()  # every thread has read the old window before any overwrites it
    s_off = slot * stride_ss + d * stride_sd + j * stride_sk
    tl.store(s_ptr + s_off, win.to(s_ptr.dtype.element_ty), mask=mask)
    if HAS_POS:
        tl.store(pos_ptr + slot + 0 * (d + j), tl.load(end_pos_ptr + last), mask=mask & first_lane)


def _conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    qsl: torch.Tensor,
    slots: torch.Tensor,
    has_init: torch.Tensor,
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    activation: str | None,
    slot_positions: torch.Tensor | None,
) -> torch.Tensor:
    """Both launches. rows [T]: each token's row; chunks: (last_chunk_indices, cu_chunk_seqlens, dest, end_pos)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    t, d = x.shape
    k = weight.shape[1]
    assert weight.shape[0] == d and conv_state.shape[1:] == (d, k - 1), "weight [D, K], conv_state [S, D, K-1]"
    nb = slots.numel()
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    init = has_init.to(torch.int8)
    block_d = min(128, max(16, triton.next_power_of_2(d)))
    ss, sd, sk = conv_state.stride()
    if t > 0:
        _conv_out_kernel[(triton.cdiv(t, BLOCK_T), triton.cdiv(d, block_d))](
            x, weight, x if bias is None else bias, conv_state, y, rows, qsl, slots, init,
            t, d, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), ss, sd, sk, y.stride(0),
            K=k, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=BLOCK_T, BLOCK_D=block_d,
        )  # fmt: skip
    if k > 1 and nb > 0:
        last, cu, dest, end_pos = chunks
        pos = slots if slot_positions is None else slot_positions
        _conv_windows_kernel[(nb, triton.cdiv(d, block_d))](
            x, conv_state, pos, qsl, slots, init, last, cu, dest, end_pos,
            d, x.stride(0), x.stride(1), ss, sd, sk,
            K=k, HAS_POS=slot_positions is not None, BLOCK_W=max(2, triton.next_power_of_2(k - 1)), BLOCK_D=block_d,
        )  # fmt: skip
    return y


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: SSMMetadata,
    activation: str | None = "silu",
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of every row; updates the running and checkpoint slots of conv_state.

    slot_positions (optional): record the position of every slot written. Reference: causal_conv1d_ref.
    Decode batches take this same path (as the torch kernel does): one chunk per row.
    """
    chunks = (meta.last_chunk_indices, meta.cu_chunk_seqlens, meta.chunk_dest_slots, meta.chunk_end_positions)
    rows = token_rows(meta.query_start_loc, x.shape[0])
    return _conv(x, weight, bias, conv_state, rows, meta.query_start_loc, meta.state_indices, meta.has_initial_state,
                 chunks, activation, slot_positions)  # fmt: skip


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: y = conv(state ++ x); the slot's window rolls by one. PAD rows output zeros.

    has_initial_state (optional [B] bool): rows marked False start from a zero window instead of the slot.
    Reference: causal_conv1d_update_ref. The varlen kernels over B one-token rows (row b = token b, one
    chunk each, no checkpoint): the index tensors are built on the device, no host sync.
    """
    b = x.shape[0]
    ar = torch.arange(b + 1, device=x.device)
    init = torch.ones(b, dtype=torch.bool, device=x.device) if has_initial_state is None else has_initial_state
    no_dest = torch.full((b,), PAD_SLOT_ID, dtype=torch.int64, device=x.device)
    chunks = (ar[:b], ar, no_dest, ar[1:])
    return _conv(x, weight, bias, conv_state, ar[:b], ar, state_indices, init, chunks, activation, None)
