"""MiniMax's lightning attention (LightningConfig) on Mamba2's SSD kernels.

transformers' block form, o_i = q_i (lam^(i+1) S_prev + sum_{j<=i} lam^(i-j) k_j^T v_j), is the recurrence
S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t; with dt = 1 (no softplus, no limit), A = log lam = -slope,
B = k, C = q, x = v, one group per head and no skip it is SSD's h_t = exp(dt A) h_{t-1} + dt x_t B_t^T,
y_t = h_t C_t, term for term (h = S^T). So prefill, decode and the checkpoint writes at any block boundary
are the SSD kernels'.
"""

from __future__ import annotations

import math

import torch

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import ModelCaches
from recap.model.layers.activation import activation
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.mixer_configs import LightningConfig

NO_LIMIT = (0.0, math.inf)


class LightningAttention(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: LightningConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.num_heads * cfg.head_dim
        self.qkv_proj = Linear(hidden_size, 3 * inner, False, dtype)
        self.output_gate = Linear(hidden_size, inner, False, dtype)
        self.out_proj = Linear(inner, hidden_size, False, dtype)
        self.norm = RMSNorm(inner, cfg.norm_eps, dtype)
        self.act = activation(cfg.activation)
        # A = -slope per head: a function of the layer index, not a weight (transformers' buffers are skipped)
        self.register_buffer("A", -cfg.slopes(layer), persistent=False)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `ssm` state ([H, head_dim v, head_dim k])."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("a lightning attention layer needs batch.ssm metadata")
        ssm_state, slot_positions = self.layer_cache(caches, layer)["ssm"], caches.slot_positions
        c = self.cfg
        t = hidden.shape[0]
        qkv = self.act(self.qkv_proj(hidden)).view(t, c.num_heads, 3 * c.head_dim)  # per head [q | k | v]
        q, k, v = (part.contiguous() for part in qkv.split(c.head_dim, dim=-1))
        dt = torch.ones(t, c.num_heads, dtype=torch.float32, device=hidden.device)
        if meta.is_decode:
            y = batch.kernels.ssd_state_update(
                ssm_state, v, dt, self.A, k, q, None, None, False, NO_LIMIT, meta.state_indices,
                slot_positions, batch.positions, meta.has_initial_state,
            )  # fmt: skip
            copy_decode_checkpoints(ssm_state, meta, slot_positions)
        else:
            y = batch.kernels.ssd(v, dt, self.A, k, q, None, None, False, NO_LIMIT, ssm_state, meta,
                                  slot_positions=slot_positions)  # fmt: skip
        y = self.norm(y.reshape(t, -1).to(hidden.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * y)
