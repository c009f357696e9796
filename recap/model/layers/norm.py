"""RMS norms, computed in fp32 and cast back (the HF order of operations, for close agreement)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.model.layers.linear import empty_param


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (no weight)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """weight * x / rms(x)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's norm before out_proj: weight * groupnorm(x * silu(z)), RMS over groups of `group_size`."""

    def __init__(self, dim: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim {dim} is not a multiple of group_size {group_size}")
        self.eps, self.group_size = eps, group_size
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(z.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)  # (..., g, group_size)
        h = rms_normalize(groups, self.eps).view(h.shape)
        return self.weight * h.to(dtype)
