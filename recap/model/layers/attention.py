"""Causal self-attention over the paged KV cache (GQA, optional partial or proportional RoPE, optional per-head
q/k RMSNorm, optional sigmoid output gate per head, optional sliding window)."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.paged_attention import paged_attention
from recap.model.config import AttentionConfig
from recap.model.layers.linear import Linear
from recap.model.layers.norm import RMSNorm
from recap.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v/o projections; K/V are written to the cache by the kernel through the slot mapping."""

    def __init__(self, hidden_size: int, cfg: AttentionConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = window  # sliding window in tokens (0: full attention); reads batch.window_attn
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(hidden_size, q_dim, cfg.bias, dtype)
        self.k_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.v_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.o_proj = Linear(q_dim, hidden_size, cfg.bias, dtype)
        rope = cfg.rope_theta is not None and cfg.rotary_dim > 0
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_angles) if rope else None  # type: ignore[arg-type]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        if cfg.output_gate:
            self.g_proj = Linear(hidden_size, cfg.num_heads, False, dtype)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        meta = batch.window_attn if self.window else batch.attn
        if meta is None:
            raise ValueError(f"an attention layer needs batch.{'window_attn' if self.window else 'attn'} metadata")
        t, c = x.shape[0], self.cfg
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)  # (t, hq, dh)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)  # (t, hkv, dh)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(batch.positions, q.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window or None)  # (t, hq, dh)
        if c.output_gate:
            out = out * torch.sigmoid(self.g_proj(x))[..., None]
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))
