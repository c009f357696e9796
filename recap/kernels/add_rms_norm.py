"""The residual add and the RMS norm that reads it, as plain torch ops: the reference of the fused kernel
(kernels/triton/add_rms_norm.py) and of the norm modules' `add_forward` (model/layers/norm.py).

h = residual + x is the block's residual add, in the stream's dtype (rounded there, as the unfused add does);
the norm reads that rounded h in fp32. The weight variants are the norm modules' (kernels/triton/rms_norm.py):
`offset`: (1 + w) in fp32 (the zero-centred norm); `weight_in_dtype`: y rounded to h's dtype, then w * y in that
dtype; otherwise the product in fp32. Both results in h's dtype.
"""

from __future__ import annotations

import torch


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     offset: bool = False, weight_in_dtype: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(normed, new_residual) of x [..., D] added to residual [..., D] (one dtype), weight [D]."""
    h = residual + x
    y = h.float()
    y = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps)
    if offset:
        y = y * (1.0 + weight.float())
    elif weight_in_dtype:
        y = weight * y.to(h.dtype)
    else:
        y = y * weight.float()
    return y.to(h.dtype), h
