"""Zaya's layer config (the state kind "cca": compressed convolutional attention), on the mixer configs'
protocol (mixer_configs.py).

A Zaya layer's slot part holds `conv_qk`, the last K-1 concatenated q/k projections that its two stacked convs
read (K = depthwise kernel + grouped kernel - 1), and `shift_v`, the previous token's input, which the delayed
half of the values projects (a zero window projects to the bias alone, as transformers' empty cache does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from recap.model.mixer_configs import MixerConfig
from recap.model.state_spec import StateTensorSpec, conv_window_spec


@dataclass(frozen=True)
class CCAConfig(MixerConfig):
    """depthwise_kernel (cca_time0), grouped_kernel (cca_time1): the depthwise conv over q/k channels, then the
    conv that mixes the channels of each q or k head over time; router_hidden_size: the width of the layer's
    MoE router, whose down-projected state the next layer's router adds (layers/zaya_moe.py)."""

    mixer: ClassVar[str] = "recap.model.layers.cca:CCAAttention"

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    depthwise_kernel: int = 2
    grouped_kernel: int = 2
    router_hidden_size: int = 256

    def __post_init__(self) -> None:
        if min(self.depthwise_kernel, self.grouped_kernel) < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"CCA: kernels >= 1 and heads a multiple of KV heads, got {self}")
        if self.window < 2 or (self.num_kv_heads * self.head_dim) % 2:
            raise ValueError("CCA: a window of >= 2 inputs and an even value width (half current, half delayed)")

    @property
    def qk_channels(self) -> int:
        return (self.num_heads + self.num_kv_heads) * self.head_dim

    @property
    def window(self) -> int:
        """The raw q/k inputs the two convs see per output (their kernels composed)."""
        return self.depthwise_kernel + self.grouped_kernel - 1

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (conv_window_spec(self.qk_channels, self.window, "conv_qk"),
                conv_window_spec(self.hidden_size, 2, "shift_v"))  # fmt: skip

    def flops_weights(self, hidden: int) -> int:
        c = self.qk_channels
        return c * self.depthwise_kernel + c * self.head_dim * self.grouped_kernel
