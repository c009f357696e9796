"""The RG-LRU recurrent block's config (Griffin / RecurrentGemma: the state kind "rglru"), on the mixer configs'
protocol (mixer_configs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from recap.model.mixer_configs import MixerConfig
from recap.model.state_spec import StateTensorSpec, conv_window_spec


@dataclass(frozen=True)
class RGLRUConfig(MixerConfig):
    """Griffin's recurrent block: y = act(linear_y(x)); u = conv_1d(linear_x(x)) (depthwise, causal, biased, no
    activation); out = linear_out(RG-LRU(u) * y). The RG-LRU, per channel, with block-diagonal gates (`num_heads`
    blocks of lru_width / num_heads channels):
        i_t = sigmoid(u_t W_i + b_i),  r_t = sigmoid(u_t W_r + b_r),  log a_t = -8 r_t softplus(Lambda)
        h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)      (at position 0: h_0 = i_0 u_0, a reset)
    A slot holds the conv window and h [lru_width] (fp32): kernels/rglru.py writes it."""

    mixer: ClassVar[str] = "recap.model.layers.rglru:RecurrentBlock"

    lru_width: int
    num_heads: int  # blocks of the gates' block-diagonal weights (the model's attention heads)
    conv_kernel: int
    activation: str = "gelu_pytorch_tanh"  # on the y branch

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.lru_width % self.num_heads:
            raise ValueError(f"lru_width {self.lru_width} must split into {self.num_heads} gate blocks")

    @property
    def block_width(self) -> int:
        return self.lru_width // self.num_heads

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return conv_window_spec(self.lru_width, self.conv_kernel), StateTensorSpec(
            "rglru", (self.lru_width,), torch.float32
        )

    def flops_weights(self, hidden: int) -> int:
        w = self.lru_width  # linear_x, linear_y, the two gates (block-diagonal), linear_out
        return 2 * hidden * w + 2 * w * self.block_width + w * hidden
