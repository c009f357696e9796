"""Rotary position embedding on the leading `rotary_dim` dims of each head (partial rotary, as in Bamba).

The rotated part uses the "rotate half" convention: dims [0, r/2) pair with [r/2, r).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """`rope_angles` (proportional RoPE): only the first rope_angles frequency pairs turn, the rest get frequency 0."""

    def __init__(self, rotary_dim: int, theta: float, rope_angles: int | None = None) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        if rope_angles is not None:
            inv_freq[rope_angles:] = 0.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] for absolute positions [T]: the fp32 angle's cos and sin evaluated in fp64
        and rounded. fp32 cos/sin are only faithful (torch's SLEEF and libm's cosf differ in the last bit for ~10%
        of angles, torch even between a tensor's vector body and its tail), and a last-bit difference can move an
        int8-quantized activation a whole step; rounded fp64 values are the same from any correct library, so
        the native RoPE (csrc/decode_ops.c, which does the same) matches this bit for bit."""
        freqs = positions[:, None].float() * self.inv_freq  # (t, r/2)
        wide = freqs.double()
        cos, sin = wide.cos().to(dtype), wide.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, Dh] -> same, first rotary_dim dims rotated."""
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos[:, None, :] + rotated * sin[:, None, :]  # cos/sin broadcast over heads
        return torch.cat((out, rest), dim=-1) if rest.numel() else out
