"""Kimi Delta Attention mixer (Kimi-Linear's linear-attention layers); the math is in kernels/kda.py.

    q, k, v = silu(conv_q(q_proj h)), silu(conv_k(k_proj h)), silu(conv_v(v_proj h))     (T, H, Dk) each
    g = -exp(A_log) * softplus(f_b_proj(f_a_proj h) + dt_bias)                           per channel, <= 0
    beta = sigmoid(b_proj h);  o = KDA(q, k, v, g, beta)  (state [H, Dk, Dk] per slot, fp32)
    y = o_proj(RMSNorm_Dk(o) * sigmoid(g_b_proj(g_a_proj h)))

State slot tensors: conv_q, conv_k, conv_v (the three conv windows) and recurrent. GLM-5.3-Flash's checkpoints
(layout "glm5") store A_log as [H] and may bound the gate below: g = bound * sigmoid(exp(A_log) * (f + dt_bias)).
Ling 3.0's (layout "bailing") also store A_log as [H], with one full-rank f_proj and g_proj for the two pairs.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import rms_normalize
from recap.model.mixer_configs import KDAConfig


class KDAMixer(Mixer):
    """Weights as on disk: q/k/v/o_proj, {q,k,v}_conv1d, f_a/f_b_proj (bailing: f_proj), dt_bias, A_log
    [1, 1, H, 1] (glm5, bailing: [H]), b_proj, g_a/g_b_proj (bailing: g_proj), o_norm [Dk]."""

    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: KDAConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        for x in "qkv":
            setattr(self, f"{x}_proj", Linear(hidden_size, d, False, dtype))
            setattr(self, f"{x}_conv1d", CausalConv1d(d, cfg.conv_kernel, False, "silu", dtype))
        if cfg.layout == "bailing":
            self.f_proj, self.g_proj = Linear(hidden_size, d, False, dtype), Linear(hidden_size, d, False, dtype)
        else:
            self.f_a_proj, self.f_b_proj = Linear(hidden_size, hd, False, dtype), Linear(hd, d, False, dtype)
            self.g_a_proj, self.g_b_proj = Linear(hidden_size, hd, False, dtype), Linear(hd, d, False, dtype)
        self.dt_bias = empty_param(d, dtype=dtype)
        a_shape = (1, 1, cfg.num_heads, 1) if cfg.layout == "kimi" else (cfg.num_heads,)
        self.A_log = empty_param(*a_shape, dtype=dtype)
        self.b_proj = Linear(hidden_size, cfg.num_heads, False, dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = empty_param(hd, dtype=dtype)
        self.o_proj = Linear(d, hidden_size, False, dtype)

    def _gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-channel log forget gate g [T, H, Dk] (fp32): -exp(A_log) * softplus(f + dt_bias), or
        bound * sigmoid(exp(A_log) * (f + dt_bias)) with a lower bound."""
        f = self.f_proj(hidden) if self.cfg.layout == "bailing" else self.f_b_proj(self.f_a_proj(hidden))
        f = f.float() + self.dt_bias.float()
        f = f.view(hidden.shape[0], self.cfg.num_heads, self.cfg.head_dim)
        rate = torch.exp(self.A_log.float().view(-1, 1))
        if self.cfg.gate_lower_bound is not None:
            return self.cfg.gate_lower_bound * torch.sigmoid(rate * f)
        return -rate * torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))  # softplus, linear past 20 (as HF)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates conv_q/k/v and recurrent of the rows' slots."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        meta = batch.ssm
        if meta is None:
            raise ValueError("a KDA layer needs batch.ssm metadata")
        t, c = hidden.shape[0], self.cfg
        shape = (t, c.num_heads, c.head_dim)
        q, k, v = (
            getattr(self, f"{x}_conv1d")(getattr(self, f"{x}_proj")(hidden), state[f"conv_{x}"], batch).view(shape)
            for x in "qkv"
        )
        g, beta = self._gate(hidden), torch.sigmoid(self.b_proj(hidden).float())
        # decode batches included
        o = batch.kernels.kda(q, k, v, g, beta, state["recurrent"], meta, slot_positions)
        gate = self.g_proj(hidden) if c.layout == "bailing" else self.g_b_proj(self.g_a_proj(hidden))
        gate = gate.float().view(shape)
        y = rms_normalize(o, c.norm_eps).mul_(self.o_norm.weight.float()).mul_(torch.sigmoid(gate))
        return self.o_proj(y.to(hidden.dtype).reshape(t, c.dim))
