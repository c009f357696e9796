"""Multi-head latent attention (Kimi-Linear's MLA: no positional encoding); the paged math is kernels/mla.py.

    q = q_proj(h)  (or q_b_proj(q_a_layernorm(q_a_proj(h))))                     (T, H, Dn + P)
    [c | kr] = kv_a_proj_with_mqa(h);  c = kv_a_layernorm(c)                       (T, R), (T, P)
    cached per token: c and kr (the layer's KVCache tensors `latent` and `rope`), never K or V
    K_h = [kv_b_proj(c)_h,nope | kr], V_h = kv_b_proj(c)_h,v;  y = o_proj(softmax(q K^T / sqrt(Dn + P)) V)
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.mixer_configs import MLAConfig


class MLAttention(Mixer):
    cache_group = "kv"

    def __init__(self, hidden_size: int, cfg: MLAConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        if window:
            raise ValueError("MLA layers have no sliding window")
        self.cfg = cfg
        h = cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, h * cfg.qk_head_dim, False, dtype)
        else:
            self.q_a_proj = Linear(hidden_size, cfg.q_lora_rank, cfg.bias, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.bias, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dtype,
                                reads_weight=True)  # the attention kernel expands the latent with it
        self.o_proj = Linear(h * cfg.v_head_dim, hidden_size, cfg.bias, dtype)
        self.scale = cfg.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError("an MLA layer needs batch.attn metadata")
        t, c = x.shape[0], self.cfg
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        cache = self.layer_cache(caches, layer)
        latent, kr = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        out = batch.kernels.paged_mla_attention(
            q.view(t, c.num_heads, c.qk_head_dim), self.kv_a_layernorm(latent), kr, cache.tensors["latent"],
            cache.tensors["rope"], batch.attn, self.kv_b_proj.weight, c.qk_nope_head_dim, self.scale,
        )  # fmt: skip
        return self.o_proj(out.reshape(t, c.num_heads * c.v_head_dim))
