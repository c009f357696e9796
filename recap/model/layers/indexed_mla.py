"""Indexed (DSA-style sparse) multi-head latent attention, GLM-5.3-Flash's "indexed_attention" (no positional
encoding); the paged math is kernels/indexed_mla.py, the indexer's projections layers/dsa_indexer.py.

    q_resid = q_a_layernorm(q_a_proj(h));  q = q_b_proj(q_resid)                      (T, H, Dn)
    c = kv_a_layernorm(kv_a_proj_with_mqa(h))                                          (T, R), cached per token
    selection = indexer(h, q_resid)  ("full"), or the previous full layer's ("shared")
    K_h = kv_b_proj(c)_h,nope, V_h = kv_b_proj(c)_h,v;  y = o_proj(softmax over the selected keys(q K^T / sqrt(Dn)) V)
"""

from __future__ import annotations

import torch

from recap.kernels.indexed_mla import Selections
from recap.kernels.metadata import ForwardBatch
from recap.model.cache import KVCache, ModelCaches
from recap.model.layers.dsa_indexer import DSAIndexer
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.mixer_configs import IndexedMLAConfig


class IndexedMLAttention(Mixer):
    cache_group = "kv"

    def __init__(self, hidden_size: int, cfg: IndexedMLAConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        if window:
            raise ValueError("indexed MLA layers have no sliding window")
        self.cfg = cfg
        h = cfg.num_heads
        self.q_a_proj = Linear(hidden_size, cfg.q_lora_rank, cfg.bias, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_nope_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden_size, cfg.kv_lora_rank, cfg.bias, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dtype,
                                reads_weight=True)  # fmt: skip  # the attention kernel expands the latent with it
        self.o_proj = Linear(h * cfg.v_head_dim, hidden_size, cfg.bias, dtype)
        self.indexer = DSAIndexer(hidden_size, cfg, dtype) if cfg.indexer == "full" else None
        self.scale = cfg.qk_nope_head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        return self.attend(x, batch, caches, layer, None)[0]

    def attend(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int,
               shared: Selections | None) -> tuple[torch.Tensor, Selections]:  # fmt: skip
        """-> (output [T, D], the selections used): a full layer selects (`shared` must be None), a shared
        layer takes the previous full layer's `shared` selections of this same batch."""
        meta = batch.attn
        if meta is None:
            raise ValueError("an indexed MLA layer needs batch.attn metadata")
        if (self.indexer is None) == (shared is None):
            raise ValueError(f"layer {layer}: a '{self.cfg.indexer}' indexer layer "
                             f"{'needs' if self.indexer is None else 'takes no'} shared selections")  # fmt: skip
        t, c = x.shape[0], self.cfg
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        cache = self.layer_cache(caches, layer)
        assert isinstance(cache, KVCache)
        sel = self.indexer(x, q_resid, batch, cache) if self.indexer is not None else shared
        assert sel is not None
        q = self.q_b_proj(q_resid).view(t, c.num_heads, c.qk_nope_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        out = batch.kernels.paged_sparse_mla_attention(q, latent, cache.tensors["latent"], meta, self.kv_b_proj.weight,
                                                       c.qk_nope_head_dim, self.scale, sel)  # fmt: skip
        return self.o_proj(out.reshape(t, c.num_heads * c.v_head_dim)), sel
