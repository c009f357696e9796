"""Qwen4-Exp's QSA attention layer: Qwen3.5's gated attention over the tokens its block indexer selects.

    [q | gate] = q_proj(x) per head;  q, k = q_norm(q), k_norm(k) ((1 + w) per head), then partial RoPE
    [iq | ik] = indexer.index_qk_proj(x): Hi query heads and one raw key of Di;  iq = RoPE(q_layernorm(iq))
    out = o_proj(attend(q, K, V over the selected tokens) * sigmoid(gate))
K, V and the raw key go to the layer's KV blocks; kernels/qsa.py selects (block keys normed with
indexer.k_layernorm) and attends.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.qsa import QSAShape
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import OffsetRMSNorm
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.qwen4_configs import QSAAttentionConfig


class QSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, cfg: QSAAttentionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.index_qk_proj = Linear(hidden_size, (cfg.index_heads + 1) * cfg.index_head_dim, False, dtype)
        self.q_layernorm = OffsetRMSNorm(cfg.index_head_dim, cfg.qk_norm_eps, dtype)
        self.k_layernorm = OffsetRMSNorm(cfg.index_head_dim, cfg.qk_norm_eps, dtype)


class QSAAttention(Mixer):
    cache_group = "kv"

    def __init__(self, hidden_size: int, cfg: QSAAttentionConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        if window or cfg.rope_theta is None or not cfg.output_gate or cfg.qk_norm != "head":
            raise ValueError("QSA attention is full, RoPE'd, output-gated and head-normed")
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(hidden_size, 2 * q_dim, cfg.bias, dtype)
        self.k_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.v_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.o_proj = Linear(q_dim, hidden_size, cfg.bias, dtype)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        self.indexer = QSAIndexer(hidden_size, cfg, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.shape = QSAShape(cfg.index_budget, cfg.index_ratio, cfg.qk_norm_eps, cfg.rotary_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError("a QSA attention layer needs batch.attn metadata")
        t, c = x.shape[0], self.cfg
        q, gate = self.q_proj(x).view(t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = self.rotary.cos_sin(batch.positions, q.dtype)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        iq, ik = self.indexer.index_qk_proj(x).split([c.index_heads * c.index_head_dim, c.index_head_dim], dim=-1)
        iq = self.rotary.apply(self.indexer.q_layernorm(iq.reshape(t, c.index_heads, c.index_head_dim)), cos, sin)
        kv = self.layer_cache(caches, layer)
        out = batch.kernels.paged_qsa_attention(
            q.contiguous(), k.contiguous(), v, iq, ik, (kv.k_cache, kv.v_cache, kv.tensors["index_key"]), batch.attn,
            self.indexer.k_layernorm.weight, self.rotary.inv_freq, self.shape, c.softmax_scale,
        )  # fmt: skip
        out = out.reshape(t, c.num_heads * c.head_dim) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
