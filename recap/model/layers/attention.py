"""Causal self-attention over the paged KV cache: GQA, optional partial or proportional RoPE, scale and
multipliers from config, optional per-head q/k RMSNorm, optional sigmoid gate per head, optional sliding window."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from recap.kernels.metadata import ForwardBatch, KVWrite
from recap.kernels.paged_decode import paged_decode_available
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous, require_type
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.layers.qk_rope import QKRope
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.mixer_configs import AttentionConfig

if TYPE_CHECKING:
    from recap.model.cache import ModelCaches


class Attention(QKRope, Mixer):
    """q/k/v/o projections; K/V are written to the cache by the kernel through the slot mapping."""

    def __init__(self, hidden_size: int, cfg: AttentionConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        if cfg.qk_norm not in ("none", "head") or cfg.output_gate:
            raise ValueError("qk_norm 'all' and a q_proj output gate are GatedAttention's (layers/gated_attention.py)")
        self.cfg = cfg
        self.window = window  # sliding window in tokens (0: full attention); reads batch.window_attn
        self.cache_group = "window" if window else "kv"
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        d_in = cfg.input_size or hidden_size
        self.q_proj = Linear(d_in, q_dim, cfg.bias, dtype)
        self.k_proj = Linear(d_in, kv_dim, cfg.bias, dtype)
        self.v_proj = Linear(d_in, kv_dim, cfg.bias, dtype)
        self.o_proj = Linear(q_dim, hidden_size, cfg.bias if cfg.o_bias is None else cfg.o_bias, dtype)
        rope = cfg.rope_theta is not None and cfg.rotary_dim > 0
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_angles) if rope else None  # type: ignore[arg-type]
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype)
        if cfg.head_gate:
            self.g_proj = Linear(d_in, cfg.num_heads, False, dtype)
        self.scale = cfg.softmax_scale
        self.native = False  # fp32 decode rows through kernels/paged_decode.py; set_native

    def set_native(self, on: bool) -> None:
        self.native = on and paged_decode_available()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        gate = torch.sigmoid(self.g_proj(x)) if self.cfg.head_gate else None
        kv = self.layer_cache(caches, layer)
        return self.attend(self.project(x), batch, kv.k_cache, kv.v_cache, gate)

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
        head_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k norms, RoPE, paged attention (K/V written to the cache), the per-head gate [T, Hq] and o_proj,
        from flat q, k, v."""
        meta = batch.window_attn if self.window else batch.attn
        if meta is None:
            raise ValueError(f"an attention layer needs batch.{'window_attn' if self.window else 'attn'} metadata")
        c = self.cfg
        t = qkv[0].shape[0]
        q = qkv[0].view(t, c.num_heads, c.head_dim)  # (t, hq, dh)
        k = qkv[1].view(t, c.num_kv_heads, c.head_dim)  # (t, hkv, dh)
        v = qkv[2].view(t, c.num_kv_heads, c.head_dim)
        norms = (self.q_norm, self.k_norm) if c.qk_norm == "head" else None
        kv = KVWrite(v, k_cache, v_cache, meta.slot_mapping)
        q, k, _, written = self.prepare_qk(q, k, batch.positions, norms, kv=kv)
        window = self.window or None
        out = batch.kernels.paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, window, self.native, written)
        if head_gate is not None:
            out = out * head_gate[..., None]
        out = self.o_proj(out.reshape(t, c.num_heads * c.head_dim))
        return out if c.output_multiplier == 1.0 else out * c.output_multiplier

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record a decode step of plain attention (GQA, RoPE or none, per-head q/k RMSNorms or none; no head gate,
        multiplier or window): projections, q/k norms, RoPE and the K/V write, paged decode attention, o_proj
        (model/capture.py)."""
        require_type(self, Attention, f"layer {layer}: mixer")
        c = self.cfg
        plain = not c.head_gate and c.input_multiplier == 1.0 and c.output_multiplier == 1.0
        if not (plain and self.native and self.window == 0
                and (self.rotary is None or type(self.rotary) is RotaryEmbedding)):  # fmt: skip
            raise GraphUnsupportedError(f"layer {layer}: attention with a gate, multipliers or a window")
        kv = caches.kv[layer]
        k_cache, v_cache = (f32_contiguous(t, f"layer {layer}'s K/V") for t in (kv.k_cache, kv.v_cache))
        if tuple(k_cache.shape[2:]) != (c.num_kv_heads, c.head_dim):
            raise GraphUnsupportedError(f"layer {layer}: K/V cache {tuple(k_cache.shape)} does not fit the layer")
        q, k, v = (p.capture_decode(builder, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        if c.qk_norm == "head":
            q, k = self.q_norm.capture_decode_heads(builder, q), self.k_norm.capture_decode_heads(builder, k)
        inv_freq = None if self.rotary is None else f32_contiguous(self.rotary.inv_freq, "inv_freq")
        if inv_freq is not None and inv_freq.numel() > 512:
            raise GraphUnsupportedError(f"layer {layer}: rotary dim {2 * inv_freq.numel()} above 1024")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(c.head_dim)
        out = builder.paged_attention(q, k, v, inv_freq, k_cache, v_cache, scale, layer)
        return self.o_proj.capture_decode(builder, out)
