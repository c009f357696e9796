"""Inkling-2's attention, its dynamic short convs and its block attention residuals (names as on disk:
Thinking Machines' `wq_du`, `wk_dv`, ...).

Attention: q (times a learned per-head scale), k and the relative states (times theirs) clipped to an L2 norm,
v RMS-normed without weight, a sink logit per head (`attn_sink_proj`), the output gated by
sigmoid(`gate_attn`(x)), scale head_dim^-0.5, the relative bias of kernels/rel_bias_attention.py. Full layers
read K and V from their own input streams, through dynamic short convs: taps = static ones + per-token ones
projected from that stream (one set per KV head), out = (y + conv(y)) / sqrt(2K + 1). Their windows are the
same state tensors as a static conv's (`conv_k`, `conv_v`): the static part runs the conv kernels (which keep
the windows and their checkpoints), the per-token part reads the windows as they were before the step.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.inkling_configs import Inkling2AttentionConfig, OutputConvsConfig
from recap.model.layers.conv import conv_windows
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.rel_bias_attention import ResidualShortConv, log_scale


def l2_clip(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each head vector (times `scale`) shrunk to L2 norm `threshold` when longer (fp32 inside)."""
    h = x.float() if scale is None else x.float() * scale.float()
    norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    return (h * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class DynamicShortConv(ResidualShortConv):
    """`static_w` [K, C] (tap k weights the input k tokens back) and `weight_proj` [H x K, D] (per-token taps of
    each of H heads, from the layer's input stream)."""

    def __init__(self, dim: int, hidden: int, heads: int, kernel: int, dtype: torch.dtype, name: str,
                 records: bool = False) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.name, self.records, self.heads, self.kernel = f"conv_{name}", records, heads, kernel
        self.static_w = empty_param(kernel, dim, dtype=dtype)
        self.weight_proj = empty_param(heads * kernel, hidden, dtype=dtype)

    def forward(self, y: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int,  # type: ignore[override]
                stream: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        meta = batch.ssm
        if meta is None or stream is None:
            raise ValueError("a dynamic short conv needs batch.ssm metadata and its input stream")
        t, c = y.shape
        windows = conv_windows(y, self.layer_cache(caches, layer)[self.name], meta)  # before the kernel moves on
        static = self.conv(y, self.static_w.t().flip(-1), batch, caches, layer)  # (c, k): oldest tap first
        taps = torch.nn.functional.linear(stream, self.weight_proj).float().view(t, self.heads, 1, self.kernel)
        dynamic = (windows.view(t, self.heads, c // self.heads, self.kernel) * taps).sum(-1).view(t, c)
        out = y.float() + static.float() + dynamic
        return (out * (2 * self.kernel + 1) ** -0.5).to(y.dtype)


class Inkling2Attention(Mixer):
    def __init__(self, hidden: int, cfg: Inkling2AttentionConfig, dtype: torch.dtype, window: int = 0) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        self.cache_group = "window" if window else "kv"
        h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_du = Linear(hidden, h * dh, False, dtype)
        self.wk_dv = Linear(hidden, hkv * dh, False, dtype)
        self.wv_dv = Linear(hidden, hkv * dh, False, dtype)
        self.wr_du = Linear(hidden, h * cfg.d_rel, False, dtype)
        self.wo_ud = Linear(h * dh, hidden, False, dtype)
        self.gate_attn = Linear(hidden, h * dh, False, dtype)
        self.attn_sink_proj = Linear(hidden, h, False, dtype)
        k = cfg.kv_conv_kernel
        if cfg.dynamic_kv:
            self.k_sconv: ResidualShortConv = DynamicShortConv(hkv * dh, hidden, hkv, k, dtype, "k", records=True)
            self.v_sconv: ResidualShortConv = DynamicShortConv(hkv * dh, hidden, hkv, k, dtype, "v")
        else:
            convs = OutputConvsConfig(hkv * dh, k, scaled=True)
            self.k_sconv = ResidualShortConv(hkv * dh, convs, dtype, "k", records=True)
            self.v_sconv = ResidualShortConv(hkv * dh, convs, dtype, "v")
        self.q_l2_clip, self.rel_l2_clip, self.rel_logits_proj = nn.Module(), nn.Module(), nn.Module()
        self.q_l2_clip.scale = empty_param(h, dh, dtype=dtype)
        self.rel_l2_clip.scale = empty_param(h, cfg.d_rel, dtype=dtype)
        self.rel_logits_proj.proj = empty_param(cfg.d_rel, cfg.rel_extent, dtype=dtype)

    def _kv(self, k_in: torch.Tensor, v_in: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
            layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        c = self.cfg
        extra = {"stream": k_in} if c.dynamic_kv else {}
        k = self.k_sconv(self.wk_dv(k_in), batch, caches, layer, **extra)
        extra = {"stream": v_in} if c.dynamic_kv else {}
        v = self.v_sconv(self.wv_dv(v_in), batch, caches, layer, **extra)
        k = l2_clip(k.view(-1, c.num_kv_heads, c.head_dim), c.qk_clip)
        return k, unweighted_rms_norm(v.view(-1, c.num_kv_heads, c.head_dim).float(), c.qk_norm_eps).to(v.dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int,
                k_in: torch.Tensor | None = None, v_in: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [T, D] (the query stream; K and V read `k_in` / `v_in` where given) -> [T, D]."""
        c, t = self.cfg, x.shape[0]
        meta = batch.window_attn if self.window else batch.attn
        if meta is None or batch.positions is None:
            raise ValueError("Inkling-2 attention needs attention metadata and positions")
        kv = self.layer_cache(caches, layer)
        k, v = self._kv(x if k_in is None else k_in, x if v_in is None else v_in, batch, caches, layer)
        q = l2_clip(self.wq_du(x).view(t, c.num_heads, c.head_dim), c.qk_clip, self.q_l2_clip.scale)
        r = l2_clip(self.wr_du(x).view(t, c.num_heads, c.d_rel), c.rel_clip, self.rel_l2_clip.scale)
        if c.log_scaling_floor is not None:
            tau = log_scale(batch.positions, c.log_scaling_floor, c.log_scaling_alpha)[:, None, None]
            q, r = (q.float() * tau).to(q.dtype), (r.float() * tau).to(r.dtype)
        rel = r @ self.rel_logits_proj.proj
        out = batch.kernels.paged_rel_bias_attention(
            q, k, v, rel, kv.k_cache, kv.v_cache, meta, c.softmax_scale, self.window or None, self.attn_sink_proj(x)
        )
        gated = out.reshape(t, -1).float() * torch.sigmoid(self.gate_attn(x).float())
        return self.wo_ud(gated.to(x.dtype))


class BlockAttentionResidual(nn.Module):
    """`query` [D] (or [n, D]): attention of n learned queries over the RMS-normed (no weight) earlier block
    states and the current partial one, per token; scale D^-0.5."""

    def __init__(self, hidden: int, queries: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.query = empty_param(hidden, dtype=dtype) if queries == 1 else empty_param(queries, hidden, dtype=dtype)

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stacked = unweighted_rms_norm(torch.stack([*blocks, partial], dim=1).float(), 1e-6)  # (t, b, d)
        d = stacked.shape[-1]
        scores = torch.einsum("qd,tbd->tqb", self.query.float().view(-1, d), stacked) * d**-0.5
        out = torch.einsum("tqb,tbd->tqd", scores.softmax(-1), stacked)
        return tuple(o.to(partial.dtype) for o in out.unbind(1))
