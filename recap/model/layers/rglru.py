"""Griffin's recurrent block (RecurrentGemma's "recurrent" temporal block; RGLRUConfig): the state kind "rglru".

    y = act(linear_y(x));  u = conv_1d(linear_x(x));  out = linear_out(RG-LRU(u) * y)

The RG-LRU's gates are per token (rg_lru.gates); its recurrence h_t = a_t h_{t-1} + x_t runs in
kernels/rglru.py over the step's chunks, which writes the running slot, every requested checkpoint and the
slot positions. The conv window is the other part of the slot (kernels/conv1d.py, as Mamba's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.activation import activation
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.rglru_config import RGLRUConfig


class RGLRU(nn.Module):
    """The RG-LRU's weights as on disk: `recurrent_param` (Lambda) [W], `input_gate_weight` and
    `recurrent_gate_weight` [H, W/H, W/H] (x @ W per block), their biases [H, W/H]."""

    def __init__(self, cfg: RGLRUConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h, bw = cfg.num_heads, cfg.block_width
        self.recurrent_param = empty_param(cfg.lru_width, dtype=dtype)
        self.input_gate_weight = empty_param(h, bw, bw, dtype=dtype)
        self.input_gate_bias = empty_param(h, bw, dtype=dtype)
        self.recurrent_gate_weight = empty_param(h, bw, bw, dtype=dtype)
        self.recurrent_gate_bias = empty_param(h, bw, dtype=dtype)

    def _gate(self, blocks: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid(u W + b) per block: blocks (h, t, bw) -> (t, w)."""
        t = blocks.shape[1]
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(t, -1))

    def gates(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, a) fp32 [T, W] of the recurrence h_t = a_t h_{t-1} + x_t, from the conv output u [T, W] and the
        tokens' absolute positions: x = sqrt(1 - a^2) (i u), a = exp(-8 r softplus(Lambda)); at position 0
        x = i u and a = 0 (transformers' reset)."""
        c = self.cfg
        blocks = u.view(u.shape[0], c.num_heads, c.block_width).transpose(0, 1)  # (h, t, bw)
        input_gate = self._gate(blocks, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self._gate(blocks, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)
        reset = (positions == 0)[:, None]
        multiplier = torch.sqrt(1 - torch.exp(2 * log_a)).masked_fill_(reset, 1.0)
        x = (u * input_gate * multiplier.to(u.dtype)).float()
        return x, torch.exp(log_a).masked_fill_(reset, 0.0).float()


class RecurrentBlock(Mixer):
    """Weights as on disk: `linear_x`, `linear_y`, `linear_out` (biased), `conv_1d` [W, 1, K] (+ bias), `rg_lru`."""

    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: RGLRUConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.lru_width
        self.linear_y = Linear(hidden_size, w, True, dtype)
        self.linear_x = Linear(hidden_size, w, True, dtype)
        self.linear_out = Linear(w, hidden_size, True, dtype)
        self.conv_1d = CausalConv1d(w, cfg.conv_kernel, True, "none", dtype)
        self.rg_lru = RGLRU(cfg, dtype)
        self.act = activation(cfg.activation)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `rglru` state tensors."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("an RG-LRU layer needs batch.ssm metadata")
        state = self.layer_cache(caches, layer)
        y = self.act(self.linear_y(hidden))
        u = self.conv_1d(self.linear_x(hidden), state["conv"], batch)
        x, a = self.rg_lru.gates(u, batch.positions)
        h = batch.kernels.rglru_scan(x, a, state["rglru"], meta, caches.slot_positions)
        return self.linear_out(h.to(hidden.dtype) * y)
