"""Inkling's attention and its residual short convs.

    k = k_sconv(k_proj(x)), v = v_sconv(v_proj(x))       sconv(y) = y + conv(y), depthwise causal, no bias
    q, k = rms_norm per head (scale 1 / head_dim), no RoPE
    rel[t, h] = r_proj(x)[t, h] @ proj                    [d_rel] @ [d_rel, E]: the query's bias by distance
    full layers from log_scaling_floor on: q, rel *= 1 + alpha * log(position / floor)
    out = o_proj(attention(q, k, v) + rel bias)          kernels/rel_bias_attention.py

K and V are cached after their convs; the conv windows (`conv_k`, `conv_v`) live in the layer's state slot part
beside the block's `conv_attn` and `conv_mlp` (inkling_configs.py)."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints, record_decode_positions
from recap.model.cache import ModelCaches
from recap.model.inkling_configs import OutputConvsConfig, RelBiasAttentionConfig
from recap.model.layers.conv import CausalConv1d, causal_conv
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm


class ResidualShortConv(Mixer):
    """y + conv(y) over `conv1d.weight` [D, 1, K] (as on disk), its window the layer's state tensor
    `conv_{name}`; `records`: this conv also records the positions the rows' slots now hold (one per layer)."""

    cache_group = "state"

    def __init__(self, dim: int, cfg: OutputConvsConfig | int, dtype: torch.dtype, name: str = "attn",
                 records: bool = False) -> None:  # fmt: skip
        super().__init__()
        kernel = cfg.kernel if isinstance(cfg, OutputConvsConfig) else cfg
        self.conv1d = CausalConv1d(dim, kernel, False, "none", dtype)
        self.name, self.records = f"conv_{name}", records
        scaled = cfg.scaled if isinstance(cfg, OutputConvsConfig) else False
        self.out_scale = (kernel + 1) ** -0.5 if scaled else 1.0  # Inkling-2's

    def forward(self, y: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """y [T, D] -> [T, D], reading and updating the rows' windows [S, D, K-1]."""
        out = y + self.conv(y, self.conv1d.weight.squeeze(1), batch, caches, layer)
        return out if self.out_scale == 1.0 else out * self.out_scale

    def conv(self, y: torch.Tensor, w: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
             layer: int) -> torch.Tensor:  # fmt: skip
        """conv(y) with taps w [D, K] over the window `conv_{name}` (updated, checkpointed, recorded)."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("a short conv needs batch.ssm metadata")
        state = self.layer_cache(caches, layer)[self.name]
        slot_positions = caches.slot_positions if self.records else None
        if slot_positions is None:
            out = causal_conv(y, state, w, None, None, batch)
        elif meta.is_decode:
            out = batch.kernels.causal_conv1d_update(
                y, state, w, None, meta.state_indices, None, meta.has_initial_state
            )
            record_decode_positions(slot_positions, meta.state_indices, batch.positions)
            copy_decode_checkpoints(state, meta, slot_positions)
        else:
            out = batch.kernels.causal_conv1d(y, w, None, state, meta, None, slot_positions)
        return out


def log_scale(positions: torch.Tensor, floor: int, alpha: float) -> torch.Tensor:
    """[T] fp32: 1 + alpha * log(max(1, (position + 1) / floor))."""
    n = (positions + 1).float()
    return 1.0 + alpha * torch.log((n / floor).clamp(min=1.0))


class RelBiasAttention(Mixer):
    def __init__(self, hidden_size: int, cfg: RelBiasAttentionConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        self.cache_group = "window" if window else "kv"
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(hidden_size, q_dim, False, dtype)
        self.k_proj = Linear(hidden_size, kv_dim, False, dtype)
        self.v_proj = Linear(hidden_size, kv_dim, False, dtype)
        self.r_proj = Linear(hidden_size, cfg.num_heads * cfg.d_rel, False, dtype)
        self.o_proj = Linear(q_dim, hidden_size, False, dtype)
        self.k_sconv = ResidualShortConv(kv_dim, cfg.kv_conv_kernel, dtype, "k", records=True)
        self.v_sconv = ResidualShortConv(kv_dim, cfg.kv_conv_kernel, dtype, "v")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        self.rel_logits_proj = nn.Module()
        self.rel_logits_proj.proj = empty_param(cfg.d_rel, cfg.rel_extent, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        meta = batch.window_attn if self.window else batch.attn
        if meta is None or batch.positions is None:
            raise ValueError("Inkling attention needs attention metadata and positions")
        kv = self.layer_cache(caches, layer)
        q = self.q_norm(self.q_proj(x).view(t, c.num_heads, c.head_dim))
        k = self.k_sconv(self.k_proj(x), batch, caches, layer)
        v = self.v_sconv(self.v_proj(x), batch, caches, layer)
        k = self.k_norm(k.view(t, c.num_kv_heads, c.head_dim))
        rel = self.r_proj(x).view(t, c.num_heads, c.d_rel) @ self.rel_logits_proj.proj  # (t, h, E)
        if c.log_scaling_floor is not None:
            tau = log_scale(batch.positions, c.log_scaling_floor, c.log_scaling_alpha)[:, None, None]
            q, rel = (q.float() * tau).to(q.dtype), (rel.float() * tau).to(rel.dtype)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        out = batch.kernels.paged_rel_bias_attention(
            q, k, v, rel, kv.k_cache, kv.v_cache, meta, c.softmax_scale, self.window or None
        )
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))

