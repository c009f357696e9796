"""Causal self-attention over the paged KV cache: GQA, optional partial RoPE, scale and multipliers from config."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.paged_attention import paged_attention
from recap.model.config import AttentionConfig
from recap.model.layers.linear import Linear
from recap.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v/o projections; K/V are written to the cache by the kernel through the slot mapping."""

    def __init__(self, hidden_size: int, cfg: AttentionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        d_in = cfg.input_size or hidden_size
        self.q_proj = Linear(d_in, q_dim, cfg.bias, dtype)
        self.k_proj = Linear(d_in, kv_dim, cfg.bias, dtype)
        self.v_proj = Linear(d_in, kv_dim, cfg.bias, dtype)
        self.o_proj = Linear(q_dim, hidden_size, cfg.bias, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta) if cfg.rope_theta is not None else None
        self.scale = cfg.softmax_scale

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return self.attend(self.project(x), batch, k_cache, v_cache)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq x Dh], k and v [T, Hkv x Dh], before RoPE (Zamba2 adds its per-use adapters to them)."""
        if self.cfg.input_multiplier != 1.0:
            x = x * self.cfg.input_multiplier
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """RoPE, paged attention (K/V written to the cache) and o_proj, from flat q, k, v."""
        if batch.attn is None:
            raise ValueError("an attention layer needs batch.attn metadata")
        c = self.cfg
        t = qkv[0].shape[0]
        q = qkv[0].view(t, c.num_heads, c.head_dim)  # (t, hq, dh)
        k = qkv[1].view(t, c.num_kv_heads, c.head_dim)  # (t, hkv, dh)
        v = qkv[2].view(t, c.num_kv_heads, c.head_dim)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(batch.positions, q.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, batch.attn, self.scale)  # (t, hq, dh)
        out = self.o_proj(out.reshape(t, c.num_heads * c.head_dim))
        return out if c.output_multiplier == 1.0 else out * c.output_multiplier
