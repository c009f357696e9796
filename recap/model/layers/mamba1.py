"""Mamba1 selective-SSM mixer (Mamba, FalconMamba, Jamba's Mamba layers).

Glossary (Mamba paper, section 3): I = d_inner, N = d_state, R = dt_rank, K = d_conv.
  x, z   : the two halves of in_proj (SSM input and output gate)
  Δ (dt) : per-channel step, dt_proj(x_proj(x)[:R]) + bias, softplus
  A      : -exp(A_log) [I, N];  B, C : input-dependent [T, N];  D : skip [I]
  h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t;  y_t = C_t h_t + D x_t;  out = out_proj(y * silu(z))
FalconMamba RMS-normalizes dt, B and C (no weights); Jamba does too, with weights.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import ModelCaches
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm, rms_normalize
from recap.model.mixer_configs import Mamba1Config


class Mamba1Mixer(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: Mamba1Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        i, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank
        self.in_proj = Linear(hidden_size, 2 * i, cfg.proj_bias, dtype)
        self.conv1d = CausalConv1d(i, cfg.d_conv, cfg.conv_bias, cfg.activation, dtype)
        self.x_proj = Linear(i, r + 2 * n, False, dtype)
        self.dt_proj = Linear(r, i, True, dtype, reads_weight=True)  # F.linear below, bias in the kernel
        self.A_log = empty_param(i, n, dtype=dtype)
        self.D = empty_param(i, dtype=dtype)
        self.out_proj = Linear(i, hidden_size, cfg.proj_bias, dtype)
        if cfg.bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(r, cfg.bcdt_norm_eps, dtype)
            self.b_layernorm = RMSNorm(n, cfg.bcdt_norm_eps, dtype)
            self.c_layernorm = RMSNorm(n, cfg.bcdt_norm_eps, dtype)
        elif cfg.bcdt_norm != "none" and cfg.bcdt_norm != "plain":
            raise ValueError(f"unknown bcdt_norm {cfg.bcdt_norm!r}")

    def _norm_bcdt(self, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.cfg.bcdt_norm == "weighted":
            return self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        if self.cfg.bcdt_norm == "plain":
            eps = self.cfg.bcdt_norm_eps
            return tuple(rms_normalize(v, eps).to(v.dtype) for v in (dt, b, c))
        return dt, b, c

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `ssm` state tensors."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        conv_state, ssm_state = state["conv"], state["ssm"]
        meta = batch.ssm
        if meta is None:
            raise ValueError("a Mamba layer needs batch.ssm metadata")
        cfg = self.cfg
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (t, i) each
        x = self.conv1d(x.contiguous(), conv_state, batch)
        dt, b, c = self.x_proj(x).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        dt, b, c = self._norm_bcdt(dt, b, c)
        dt = torch.nn.functional.linear(dt, self.dt_proj.weight)  # (t, i); bias added in the kernel
        a = -torch.exp(self.A_log.float())  # (i, n)
        d, dt_bias = self.D.float(), self.dt_proj.bias.float()
        z = z.contiguous()
        if meta.is_decode:
            y = batch.kernels.selective_state_update(
                ssm_state, x, dt, a, b.contiguous(), c.contiguous(), d, z, dt_bias, True,
                meta.state_indices, slot_positions, batch.positions, meta.has_initial_state,
            )  # fmt: skip
            copy_decode_checkpoints(ssm_state, meta, slot_positions)
        else:
            y = batch.kernels.selective_scan(
                x, dt, a, b.contiguous(), c.contiguous(), d, z, dt_bias, True, ssm_state, meta,
                slot_positions=slot_positions,
            )  # fmt: skip
        return self.out_proj(y.to(hidden.dtype))
