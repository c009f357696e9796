"""RWKV-4's layer config (the state kind "rwkv": time mix + channel mix, each with a token shift), on the mixer
configs' protocol (mixer_configs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from recap.model.mixer_configs import MixerConfig
from recap.model.state_spec import StateTensorSpec, conv_window_spec


@dataclass(frozen=True)
class RwkvConfig(MixerConfig):
    """An RWKV-4 layer: the time mix (layers/rwkv.py RwkvTimeMix: receptance-gated WKV over keys and values
    interpolated with the previous token's input) and the channel mix (RwkvChannelMix: a squared-relu MLP on the
    same interpolation). A slot holds each mix's previous input (a conv window of one) and the WKV state
    (num, den, max) [3, attention_size] in fp32: kernels/wkv.py writes it.

    rescale_every: transformers' inference rescaling (a positive r: layer i's two output projections divided by
    2 ** (i // r), the residual stream halved after every r-th layer), which the model file reproduces exactly
    (powers of two); 0 or less: none."""

    mixer: ClassVar[str] = "recap.model.layers.rwkv:RwkvTimeMix"
    per_layer: ClassVar[bool] = True  # the output scale depends on the layer (rescale_every)

    hidden_size: int  # the token shifts' width (the model's)
    attention_size: int  # attention_hidden_size: the WKV channels
    intermediate_size: int  # the channel mix's key width
    rescale_every: int = 0

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.attention_size, self.intermediate_size)
        if min(sizes) < 1:
            raise ValueError(f"RWKV sizes (hidden, attention, intermediate) must be positive: {sizes}")

    def output_scale(self, layer: int) -> float:
        """The factor on layer `layer`'s two output projections (transformers' rescaled weights)."""
        return 1.0 if self.rescale_every <= 0 else 2.0 ** -(layer // self.rescale_every)

    def halves_after(self, layer: int) -> bool:
        """Whether the residual stream is halved after layer `layer`."""
        return self.rescale_every > 0 and (layer + 1) % self.rescale_every == 0

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (
            StateTensorSpec("wkv", (3, self.attention_size), torch.float32),
            conv_window_spec(self.hidden_size, 2, "shift_att"),
            conv_window_spec(self.hidden_size, 2, "shift_ffn"),
        )

    def flops_weights(self, hidden: int) -> int:
        a, f = self.attention_size, self.intermediate_size  # key/value/receptance/output; key/receptance/value
        return 4 * hidden * a + 2 * hidden * f + hidden * hidden
