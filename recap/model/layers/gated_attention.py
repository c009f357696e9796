"""Causal self-attention with q/k RMSNorm and an optional output gate, over the paged KV cache.

- Qwen3.5 / Qwen3-Next ("gated attention"): q_proj yields [q (Dh) | gate (Dh)] per head; q and k are RMS-normed
  per head (zero-centred (1 + w) norms in these families) before a partial RoPE; out = o_proj(o * sigmoid(gate)).
- OLMo-Hybrid: q and k are RMS-normed over all heads at once (weights [H Dh] and [Hkv Dh]); full RoPE or none.
The norm class is the family's (`norm_cls`); the rest follows `AttentionConfig.qk_norm` / `output_gate`.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch, KVWrite
from recap.kernels.paged_decode import paged_decode_available
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous, require_type
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import OffsetRMSNorm, RMSNorm
from recap.model.layers.qk_rope import QKRope
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.mixer_configs import AttentionConfig

QK_NORMS = ("none", "head", "all")


class GatedAttention(QKRope, Mixer):
    cache_group = "kv"

    def __init__(
        self, hidden_size: int, cfg: AttentionConfig, eps: float, dtype: torch.dtype, norm_cls: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        if cfg.qk_norm not in QK_NORMS:
            raise ValueError(f"unknown qk_norm {cfg.qk_norm!r}; choose one of {QK_NORMS}")
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(hidden_size, q_dim * (2 if cfg.output_gate else 1), cfg.bias, dtype)
        self.k_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.v_proj = Linear(hidden_size, kv_dim, cfg.bias, dtype)
        self.o_proj = Linear(q_dim, hidden_size, cfg.bias, dtype)
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = norm_cls(cfg.head_dim if per_head else q_dim, eps, dtype)
            self.k_norm = norm_cls(cfg.head_dim if per_head else kv_dim, eps, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta) if cfg.rope_theta is not None else None
        self.scale = cfg.head_dim**-0.5
        self.native = False  # fp32 decode rows through kernels/paged_decode.py; set_native

    def set_native(self, on: bool) -> None:
        self.native = on and paged_decode_available()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError("an attention layer needs batch.attn metadata")
        t, c = x.shape[0], self.cfg
        gate = None
        if c.output_gate:  # q_proj's rows per head: [q | gate]; both stay strided views until prepare_qk
            q, gate = self.q_proj(x).view(t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x)
        k, v = self.k_proj(x), self.v_proj(x)
        if c.qk_norm == "all":
            q, k = self.q_norm(q.reshape(t, -1)), self.k_norm(k)
        q = q.reshape(t, c.num_heads, c.head_dim)  # (t, hq, dh); the gated q's strided view stays one
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        head_norms = (self.q_norm, self.k_norm) if c.qk_norm == "head" else None
        v = v.view(t, c.num_kv_heads, c.head_dim)
        kv = self.layer_cache(caches, layer)
        write = KVWrite(v, kv.k_cache, kv.v_cache, batch.attn.slot_mapping)
        q, k, gate, written = self.prepare_qk(q, k, batch.positions, head_norms, gate, write)
        out = batch.kernels.paged_attention(q.contiguous(), k.contiguous(), v, kv.k_cache, kv.v_cache, batch.attn,
                                            self.scale, None, self.native, written)  # fmt: skip
        out = out.reshape(t, c.num_heads * c.head_dim)
        if gate is not None:
            out = out * gate
        return self.o_proj(out)

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record a decode step (model/capture.py): the projections, q's split from its gate (sigmoid), per-head
        q/k norms (plain or zero-centred) or none, RoPE (partial: the first rotary_dim dims) and the K/V write,
        paged decode attention, the output gate, o_proj."""
        require_type(self, GatedAttention, f"layer {layer}: mixer")
        c = self.cfg
        norms_ok = c.qk_norm == "none" or (c.qk_norm == "head" and type(self.q_norm) in (RMSNorm, OffsetRMSNorm))
        rope_ok = self.rotary is None or (type(self.rotary) is RotaryEmbedding and self.rope_kernel is None)
        if not (self.native and norms_ok and rope_ok):
            raise GraphUnsupportedError(f"layer {layer}: gated attention with q/k norms over all heads, a fused "
                                        "kernel, or no native paged decode")  # fmt: skip
        kv = caches.kv[layer]
        k_cache, v_cache = (f32_contiguous(t, f"layer {layer}'s K/V") for t in (kv.k_cache, kv.v_cache))
        if tuple(k_cache.shape[2:]) != (c.num_kv_heads, c.head_dim):
            raise GraphUnsupportedError(f"layer {layer}: K/V cache {tuple(k_cache.shape)} does not fit the layer")
        q, k, v = (p.capture_decode(builder, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        gate = None
        if c.output_gate:
            q, gate = builder.split_gate(q, c.num_heads, c.head_dim)
        if c.qk_norm == "head":
            q, k = self.q_norm.capture_decode_heads(builder, q), self.k_norm.capture_decode_heads(builder, k)
        inv_freq = None if self.rotary is None else f32_contiguous(self.rotary.inv_freq, "inv_freq")
        if inv_freq is not None and inv_freq.numel() > 512:
            raise GraphUnsupportedError(f"layer {layer}: rotary dim {2 * inv_freq.numel()} above 1024")
        out = builder.paged_attention(q, k, v, inv_freq, k_cache, v_cache, self.scale, layer)
        if gate is not None:
            builder.mul(out, gate)
        return self.o_proj.capture_decode(builder, out)
