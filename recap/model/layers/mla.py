"""Multi-head latent attention (Kimi-Linear's MLA: no positional encoding; Ling 3.0's: RoPE and a per-head
output gate); the paged math is kernels/mla.py.

    q = q_proj(h)  (or q_b_proj(q_a_layernorm(q_a_proj(h))))                     (T, H, Dn + P)
    [c | kr] = kv_a_proj_with_mqa(h);  c = kv_a_layernorm(c)                       (T, R), (T, P)
    with rope_theta: q's last P dims and kr rotated, DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...
    (= de-interleave [x0, x2, ... | x1, x3, ...], then rotate-half RoPE: the layout transformers attends in)
    cached per token: c and kr (the layer's KVCache tensors `latent` and `rope`), never K or V
    K_h = [kv_b_proj(c)_h,nope | kr], V_h = kv_b_proj(c)_h,v;  o = softmax(q K^T / sqrt(Dn + P)) V
    with head_gate: o_h *= sigmoid(g_proj(h))_h;  y = o_proj(o)
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.mixer_configs import MLAConfig


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., P] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...] (rotate-half order)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


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
        if cfg.head_gate:
            self.g_proj = Linear(hidden_size, h, False, dtype)
        rope = cfg.rope_theta is not None and cfg.qk_rope_head_dim > 0
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta) if rope else None  # type: ignore[arg-type]
        self.scale = cfg.qk_head_dim**-0.5

    def _rotate(self, q: torch.Tensor, kr: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, Dn + P], kr [T, P] with their rope dims rotated at `positions` (interleaved pairs)."""
        assert self.rotary is not None
        n = self.cfg.qk_nope_head_dim
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        q_rot = self.rotary.apply(deinterleave(q[..., n:]), cos, sin)
        kr = self.rotary.apply(deinterleave(kr)[:, None, :], cos, sin)[:, 0]
        return torch.cat((q[..., :n], q_rot), dim=-1), kr

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError("an MLA layer needs batch.attn metadata")
        t, c = x.shape[0], self.cfg
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        cache = self.layer_cache(caches, layer)
        latent, kr = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q = q.view(t, c.num_heads, c.qk_head_dim)
        if self.rotary is not None:
            q, kr = self._rotate(q, kr, batch.positions)
        out = batch.kernels.paged_mla_attention(
            q, self.kv_a_layernorm(latent), kr, cache.tensors["latent"],
            cache.tensors["rope"], batch.attn, self.kv_b_proj.weight, c.qk_nope_head_dim, self.scale,
        )  # fmt: skip
        if c.head_gate:  # sigmoid in fp32, as transformers
            out = out * torch.sigmoid(self.g_proj(x).float()).to(out.dtype)[..., None]
        return self.o_proj(out.reshape(t, c.num_heads * c.v_head_dim))
