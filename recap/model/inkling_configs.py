"""Inkling's mixer configs: its attention (K and V through residual short convs, RMS-normed q/k, no RoPE but a
per-query relative bias, log-scaled queries on long full-attention contexts) and the residual short convs on
the outputs of a layer's attention and feed-forward (the state of the "conv_attention" kind).

A conv_attention layer's state slot holds four conv windows: `conv_k`, `conv_v` (declared by the attention's
config, so they follow its KV width, which differs between full and sliding layers) and `conv_attn`,
`conv_mlp` over the hidden size (OutputConvsConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from recap.model.mixer_configs import AttentionConfig, MixerConfig
from recap.model.state_spec import StateTensorSpec, conv_window_spec


@dataclass(frozen=True)
class RelBiasAttentionConfig(AttentionConfig):
    """rel_extent: backward distances the bias covers (the window, in sliding layers); log_scaling_floor: from
    this position on queries and bias are scaled by 1 + alpha * log(position / floor) (None: never)."""

    kv_conv_kernel: int = 4
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_floor: int | None = None
    log_scaling_alpha: float = 0.1
    mixer: ClassVar[str] = "recap.model.layers.rel_bias_attention:RelBiasAttention"

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        kv_dim = self.num_kv_heads * self.head_dim
        return tuple(conv_window_spec(kv_dim, self.kv_conv_kernel, f"conv_{x}") for x in "kv")

    def flops_weights(self, hidden: int) -> int:
        return super().flops_weights(hidden) + hidden * self.num_heads * self.d_rel


@dataclass(frozen=True)
class OutputConvsConfig(MixerConfig):
    """The residual short convs x + conv(x) (depthwise, causal, no bias) on a layer's attention output and
    feed-forward output."""

    dim: int
    kernel: int
    scaled: bool = False  # (x + conv(x)) / sqrt(kernel + 1) (Inkling-2)
    mixer: ClassVar[str] = "recap.model.layers.rel_bias_attention:ResidualShortConv"

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return tuple(conv_window_spec(self.dim, self.kernel, f"conv_{x}") for x in ("attn", "mlp"))

    def flops_weights(self, hidden: int) -> int:
        return 2 * self.dim * self.kernel


@dataclass(frozen=True)
class Inkling2AttentionConfig(RelBiasAttentionConfig):
    """Inkling-2's attention over RelBiasAttentionConfig's: q (after a learned per-head scale), k and the relative
    states (after theirs) clipped to an L2 norm; v RMS-normed without weight; a sink logit per head and a sigmoid
    gate on the output (both from the query input); `dynamic_kv` (full layers): K and V read their own input
    streams, through short convs whose taps add per-token ones projected from those streams."""

    qk_clip: float = 22.627416997969522
    rel_clip: float = 8.0
    dynamic_kv: bool = False
    mixer: ClassVar[str] = "recap.model.layers.inkling2:Inkling2Attention"

    def flops_weights(self, hidden: int) -> int:
        gate_sink = hidden * self.num_heads * (self.head_dim + 1)
        dynamic = 2 * hidden * self.num_kv_heads * self.kv_conv_kernel if self.dynamic_kv else 0
        return super().flops_weights(hidden) + gate_sink + dynamic
