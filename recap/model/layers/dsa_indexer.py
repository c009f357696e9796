"""The DSA-style indexer's projections (GLM-5.3-Flash): from a token's hidden state x and query residual
q_resid = q_a_layernorm(q_a_proj(x)) to what kernels/dsa_indexer.py selects with.

    q = wq_b(q_resid)  (T, Hi, Di);  w = weights_proj(x) / sqrt(Hi)  (T, Hi)
    key = LayerNorm(wk(x))  (T, Di);  gate = index_kpool_compress_gate @ x  (T, Di);  ape (P, Di)
Keys and gates go to the layer's KV blocks (index_key, index_gate) before the selection reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.dsa_indexer import IndexerShape
from recap.kernels.indexed_mla import Selections
from recap.kernels.metadata import ForwardBatch
from recap.model.cache import KVCache
from recap.model.layers.linear import Linear, empty_param
from recap.model.mixer_configs import IndexedMLAConfig

K_NORM_EPS = 1e-6  # the checkpoint's LayerNorm on the indexer keys


class DSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, cfg: IndexedMLAConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hi, di = cfg.index_heads, cfg.index_head_dim
        self.heads, self.head_dim = hi, di
        self.shape = IndexerShape(topk=cfg.index_topk, kpool=cfg.index_kpool, tail=cfg.index_tail)
        self.wq_b = Linear(cfg.q_lora_rank, hi * di, False, dtype)
        self.wk = Linear(hidden_size, di, False, dtype)
        self.k_norm = nn.LayerNorm(di, eps=K_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(hidden_size, hi, False, dtype)
        self.index_kpool_compress_ape = empty_param(cfg.index_kpool, di, dtype=dtype)
        self.index_kpool_compress_gate = empty_param(di, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> Selections:
        """Cache the tokens' indexer keys and gates, then each row's selection (None for padding rows)."""
        assert batch.attn is not None
        t = x.shape[0]
        q = self.wq_b(q_resid).view(t, self.heads, self.head_dim)
        w = self.weights_proj(x).float() * self.heads**-0.5
        key = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        return batch.kernels.paged_dsa_select(q, w, key, gate, cache.tensors["index_key"],
                                              cache.tensors["index_gate"], batch.attn, self.index_kpool_compress_ape,
                                              self.shape)  # fmt: skip
