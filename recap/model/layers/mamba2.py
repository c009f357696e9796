"""Mamba2 (SSD) mixer, as in Mamba2, Bamba and other Mamba2 hybrids.

Glossary (Mamba2 paper, section 7): H heads of P = head_dim channels, G groups sharing B and C,
N = d_state, I = H * P.
  in_proj(x) = [z (I) | xBC (I + 2 G N) | dt (H)];  xBC -> causal conv + silu -> [x | B | C]
  A = -exp(A_log) [H] (scalar per head);  dt = clamp(softplus(dt + dt_bias), time_step_limit)
  h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t;  y_t = C_t h_t + D x_t  (the SSD kernels)
  out = out_proj(gated_rmsnorm(y, z))  with RMS over groups of I / G channels
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.ssd import ssd_varlen
from recap.kernels.ssd_decode import ssd_state_update
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import StateCache
from recap.model.config import Mamba2Config
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.norm import GatedRMSNorm


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, cfg: Mamba2Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj = Linear(hidden_size, cfg.in_proj_dim, cfg.proj_bias, dtype)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.d_conv, cfg.conv_bias, cfg.activation, dtype)
        self.dt_bias = empty_param(cfg.num_heads, dtype=dtype)
        self.A_log = empty_param(cfg.num_heads, dtype=dtype)
        self.D = empty_param(cfg.num_heads, dtype=dtype)
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.n_groups, cfg.norm_eps, dtype)
        self.out_proj = Linear(cfg.d_inner, hidden_size, cfg.proj_bias, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        state: StateCache,
        slot_positions: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `ssm` state tensors."""
        conv_state, ssm_state = state["conv"], state["ssm"]
        meta = batch.ssm
        if meta is None:
            raise ValueError("a Mamba2 layer needs batch.ssm metadata")
        c = self.cfg
        t = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split([c.d_inner, c.conv_dim, c.num_heads], dim=-1)
        xbc = self.conv1d(xbc.contiguous(), conv_state, meta)  # (t, conv_dim)
        gn = c.n_groups * c.d_state
        x, b, cc = xbc.split([c.d_inner, gn, gn], dim=-1)
        x = x.reshape(t, c.num_heads, c.head_dim)  # (t, h, p)
        b = b.reshape(t, c.n_groups, c.d_state)  # (t, g, n)
        cc = cc.reshape(t, c.n_groups, c.d_state)
        dt = dt.contiguous()  # (t, h)
        a = -torch.exp(self.A_log.float())  # (h,)
        d, dt_bias = self.D.float(), self.dt_bias.float()
        if meta.is_decode:
            y = ssd_state_update(
                ssm_state, x, dt, a, b, cc, d, dt_bias, True, c.time_step_limit, meta.state_indices,
                slot_positions, batch.positions, meta.has_initial_state,
            )  # fmt: skip
            copy_decode_checkpoints(ssm_state, meta, slot_positions)
        else:
            y = ssd_varlen(
                x, dt, a, b, cc, d, dt_bias, True, c.time_step_limit, ssm_state, meta,
                slot_positions=slot_positions,
            )  # fmt: skip
        y = self.norm(y.reshape(t, c.d_inner), z)
        return self.out_proj(y.to(hidden.dtype))
