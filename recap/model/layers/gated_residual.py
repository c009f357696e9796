"""Qwen4-Exp's hyper-connections ("gated residual"): N residual streams per token, [T, N D] side by side.

    y = hc_norm(S)                          (1 + w) RMSNorm over each stream's D channels
    m = sigmoid(up(silu(down(y) / N)))      [T, N D], a rank-R mixer
    x = mean over streams of m * y          the block's input [T, D]
    w = 2 sigmoid(block_inject(y) / N)      [T, N], one weight per stream
after the block: S = S + w (x) block(x)     (expand); the model's last mixer has no inject weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.norm import rms_normalize
from recap.model.model_config import GatedResidualConfig


class GroupedOffsetRMSNorm(nn.Module):
    """(1 + w) * x / rms(x), the RMS over each group of `group` channels (fp32, cast back)."""

    def __init__(self, dim: int, group: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x.unflatten(-1, (-1, self.group)), self.eps).flatten(-2)
        return y.mul_(1.0 + self.weight.float()).to(x.dtype)


class GatedResidual(nn.Module):
    def __init__(self, hidden: int, cfg: GatedResidualConfig, eps: float, dtype: torch.dtype, inject: bool = True):
        super().__init__()
        self.streams, self.hidden = cfg.streams, hidden
        width = cfg.streams * hidden
        self.hc_norm = GroupedOffsetRMSNorm(width, hidden, eps, dtype)
        self.input_mix_weight_down = Linear(width, cfg.rank, False, dtype)
        self.input_mix_weight_up = Linear(cfg.rank, width, False, dtype)
        if inject:
            self.block_inject_weight = Linear(width, cfg.streams, False, dtype)

    def mix(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N D] -> the block input [T, D]."""
        return self._mix(self.hc_norm(streams))

    def _mix(self, y: torch.Tensor) -> torch.Tensor:
        m = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(y) / self.streams)))
        return (m * y).unflatten(-1, (self.streams, self.hidden)).mean(dim=-2)

    def around(self, streams: torch.Tensor, block: nn.Module) -> torch.Tensor:
        """streams [T, N D] -> streams + inject weights (x) block(mixed input)."""
        y = self.hc_norm(streams)
        out = block(self._mix(y))
        w = 2 * torch.sigmoid(self.block_inject_weight(y) / self.streams)  # (t, n)
        return streams + (out[:, None, :] * w[:, :, None]).flatten(-2)
