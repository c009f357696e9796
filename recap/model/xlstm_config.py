"""xLSTM's layer config (the state kind "mlstm": the mLSTM cell of xLSTM-7B), on the mixer configs' protocol
(mixer_configs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from recap.kernels.mlstm import state_width
from recap.model.mixer_configs import MixerConfig
from recap.model.state_spec import StateTensorSpec

WEIGHT_MODES = ("single", "fused")  # separate q/k/v/o and gate projections, or one of each kind


@dataclass(frozen=True)
class XlstmConfig(MixerConfig):
    """An mLSTM layer (layers/xlstm.py MlstmLayer): per head a matrix memory over q/k/v with exponential input and
    sigmoid forget gates, a per-head layer norm, an output gate. A slot holds per head C [K, V], n [K] and m in
    fp32 (kernels/mlstm.py's packed layout). `qk_dim`, `v_dim`: the layer's widths (transformers truncates
    hidden * factor, without the config's rounding to 64); `gate_soft_cap`: cap * tanh(x / cap) on the gate
    pre-activations (None: none); `eps`: the cell's denominator eps (part of the output, not only numerics)."""

    mixer: ClassVar[str] = "recap.model.layers.xlstm:MlstmLayer"

    num_heads: int
    qk_dim: int
    v_dim: int
    ffn_size: int  # the block's gated feed-forward width (layers/xlstm.py XlstmFeedForward), part of the layer
    weight_mode: str = "single"
    use_bias: bool = False
    gate_soft_cap: float | None = 15.0
    eps: float = 1e-6
    norm_eps: float = 1e-6
    force_float32_norm: bool = True  # norm_reduction_force_float32

    def __post_init__(self) -> None:
        if self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"xLSTM weight_mode {self.weight_mode!r} is not one of {WEIGHT_MODES}")
        if (
            min(self.num_heads, self.qk_dim, self.v_dim, self.ffn_size) < 1
            or self.qk_dim % self.num_heads
            or self.v_dim % self.num_heads
        ):
            raise ValueError(f"xLSTM widths qk {self.qk_dim}, v {self.v_dim} must be positive multiples of the "
                             f"{self.num_heads} heads")  # fmt: skip

    @property
    def qk_head_dim(self) -> int:
        return self.qk_dim // self.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.v_dim // self.num_heads

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (StateTensorSpec("mlstm", (self.num_heads, state_width(self.qk_head_dim, self.v_head_dim)),
                                torch.float32),)  # fmt: skip

    def flops_weights(self, hidden: int) -> int:
        # q, k; v and the output gate; the two gates; out_proj; the feed-forward's three
        return (
            hidden * (2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_heads)
            + self.v_dim * hidden
            + (3 * hidden * self.ffn_size)
        )
