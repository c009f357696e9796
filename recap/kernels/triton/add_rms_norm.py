"""Triton residual add + RMS norm, one launch: the GPU twin of `h = h + out; x = norm(h)` (vLLM's
fused_add_rms_norm), where a block's residual add feeds the next norm (the feed-forward's pre-norm, the next
block's input norm, the final norm). Unfused, a decode step launches the add and then the norm (itself one launch
with kernels/triton/rms_norm.py); here one program per row does both in registers and writes both results.

Order of operations, that of the unfused ops (kernels/add_rms_norm.py is the reference):
- h = residual + x, rounded to the stream's dtype and written (the new residual, a new tensor: neither input
  is written, so a caller holding h or x keeps it);
- y = h / rms(h) in fp32, from the rounded h, as the norm reads the stored stream;
- the weight as the norm modules take it: `offset` (1 + w) in fp32, `weight_in_dtype` y rounded to the dtype and
  the product in that dtype, otherwise the product in fp32; y in the dtype.
A row's result depends on that row alone (batch-invariant), as rms_norm's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.triton.rms_norm import _rows


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, stride_x, stride_r, eps,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, OFFSET: tl.constexpr, IN_DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < WIDTH
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (r + x).to(h_ptr.dtype.element_ty)  # the stream's dtype, as the unfused add rounds it
    tl.store(h_ptr + row * WIDTH + cols, h, mask=mask)
    h = h.to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / WIDTH + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = y * (1.0 + w)
    elif IN_DTYPE:  # y in the dtype, then the product in that dtype (a product of two such values, rounded once)
        y = (w * y.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y * w
    tl.store(y_ptr + row * WIDTH + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 offset: bool = False, weight_in_dtype: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(normed, new_residual) of x [..., D] added to residual [..., D] of the same shape and dtype, weight [D],
    as the module docstring says; two new tensors of x's shape and dtype."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"the fused residual add needs x and the residual of one shape and dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")  # fmt: skip
    width = x.shape[-1]
    if weight.numel() != width:
        raise ValueError(
            f"a norm over rows of {width} channels needs a weight of {width} entries, got {weight.numel()}"
        )
    xr, rr = _rows(x, width), _rows(residual, width)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(xr.shape[0],)](
            xr, rr, weight, y, h, xr.stride(0), rr.stride(0), eps,
            WIDTH=width, BLOCK=block, OFFSET=offset, IN_DTYPE=weight_in_dtype, num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return y, h
