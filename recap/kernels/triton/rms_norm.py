"""Triton RMS norm, one launch per norm: the GPU twin of the norm modules' torch ops (model/layers/norm.py).

On an H100 a batch-1 decode step of a 1.2B hybrid replayed ~625 kernels (a 2.3B Qwen3.5-like one ~1,920), each
~2.4 us however little it does; an RMS norm written in torch ops is 6-9 of them (the fp32 cast, the reduction,
the rsqrt, the products, the casts back), for the residual norms, the gated norms of Mamba2 and Gated DeltaNet,
and the q/k norms. One program per (row, group) does the whole norm in registers.

Every variant the norm modules compute, in their order of operations (each module's forward is the reference):
- y = x / rms(x) over groups of `group` channels (the whole row by default), in fp32;
- `gate` z with `gate_first`: x * silu(z) is normalized (Mamba2's gated norm); without: the result is multiplied
  by silu(z) last (Gated DeltaNet's output norm, Falcon-H1's norm-before-gate);
- the weight (of the row's width, or of one group's, shared by every group): `offset` multiplies by (1 + w) in
  fp32 (Qwen3-Next's zero-centred norm); `weight_in_dtype` rounds y to x's dtype first and takes the product in
  that dtype (transformers' `weight * y.to(dtype)`); otherwise the product is fp32;
- the output in x's dtype.
A row's result does not depend on the other rows (batch-invariant): a prefill row and the decode step of the same
token give the same bits, as cached = uncached needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATE_NONE, GATE_FIRST, GATE_LAST = 0, 1, 2


@triton.jit
def _rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, stride_x, stride_z, groups_per_row, w_groups, eps,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, GATE: tl.constexpr, OFFSET: tl.constexpr, IN_DTYPE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = pid // groups_per_row
    g = pid % groups_per_row
    cols = tl.arange(0, BLOCK)
    mask = cols < GROUP
    x = tl.load(x_ptr + row * stride_x + g * GROUP + cols, mask=mask, other=0.0).to(tl.float32)
    if GATE != 0:
        z = tl.load(z_ptr + row * stride_z + g * GROUP + cols, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if GATE == 1:
            x = x * gate
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / GROUP + eps)
    w = tl.load(w_ptr + (g % w_groups) * GROUP + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = y * (1.0 + w)
    elif IN_DTYPE:  # y in x's dtype, then the product in that dtype (a product of two such values, rounded once)
        y = (w * y.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y * w
    if GATE == 2:
        y = y * gate
    tl.store(y_ptr + pid * GROUP + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as rows of `width` channels whose channels are adjacent (a view where torch can make one)."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, group: int | None = None,
             gate: torch.Tensor | None = None, gate_first: bool = False, offset: bool = False,
             weight_in_dtype: bool = False) -> torch.Tensor:  # fmt: skip
    """x [..., D] normalized over groups of `group` channels (D when None) with `weight` [D] or [group], as the
    module docstring says; a new tensor of x's shape and dtype."""
    width = x.shape[-1]
    group = width if group is None else group
    if width % group or weight.numel() not in (group, width):
        raise ValueError(f"a norm over groups of {group} needs rows whose width ({width}) they divide and a weight "
                         f"of {group} or {width} entries, got {weight.numel()}")  # fmt: skip
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"the gate's shape {tuple(gate.shape)} is not x's {tuple(x.shape)}")
    xr = _rows(x, width)
    zr = xr if gate is None else _rows(gate, width)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups_per_row = width // group
    n = xr.shape[0] * groups_per_row
    if n:
        mode = GATE_NONE if gate is None else GATE_FIRST if gate_first else GATE_LAST
        block = triton.next_power_of_2(group)
        _rms_norm_kernel[(n,)](
            xr, zr, weight, y, xr.stride(0), zr.stride(0), groups_per_row, weight.numel() // group, eps,
            GROUP=group, BLOCK=block, GATE=mode, OFFSET=offset, IN_DTYPE=weight_in_dtype,
            num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return y
