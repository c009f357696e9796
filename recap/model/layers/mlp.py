"""Dense feed-forward: gated down(act(gate(x) * gm) * up(x)) * dm, or non-gated down(act(up(x)))."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recap.model.capture import DecodeCapture, GraphUnsupportedError, require_type
from recap.model.feed_forward_configs import MLPConfig
from recap.model.layers.activation import activation
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer

if TYPE_CHECKING:
    from recap.kernels.metadata import ForwardBatch
    from recap.model.cache import ModelCaches


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of fused [.., 2I] rows: the two halves, or alternating rows when `interleaved`."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up


def clamp_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's gate clamped to <= limit and up to [-limit, limit] (None: unchanged)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)


class MLP(Mixer):
    """Weights as on disk: `gate_proj`, `up_proj`, `down_proj`; `gate_up_proj` when fused; no gate if not gated."""

    def __init__(self, hidden_size: int, cfg: MLPConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        i = cfg.intermediate_size
        if cfg.gated and cfg.fused_gate_up:
            self.gate_up_proj = Linear(hidden_size, 2 * i, cfg.bias, dtype)
        elif cfg.gated:
            self.gate_proj = Linear(hidden_size, i, cfg.bias, dtype)
            self.up_proj = Linear(hidden_size, i, cfg.bias, dtype)
        else:
            self.up_proj = Linear(hidden_size, i, cfg.bias, dtype)
        self.down_proj = Linear(i, hidden_size, cfg.bias, dtype)
        self.act = activation(cfg.activation)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """[gate | up] rows of x, [T, 2I] (gated MLPs only; Zamba2 adds its adapters to this)."""
        if self.cfg.fused_gate_up:
            return self.gate_up_proj(x)
        return torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate * gm) * up) * dm from [gate | up]."""
        gate, up = clamp_swiglu(*split_gate_up(gate_up, self.cfg.interleaved_gate_up), self.cfg.swiglu_limit)
        out = self.down_proj(self._act(gate).mul_(up))
        return out if self.cfg.down_multiplier == 1.0 else out * self.cfg.down_multiplier

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        gm = self.cfg.gate_multiplier
        return self.act(gate if gm == 1.0 else gate * gm)  # a fresh tensor either way

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch | None = None,
        caches: ModelCaches | None = None,
        layer: int | None = None,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]. As a layer's mixer it is called like any mixer (layers/mixer.py) and reads no cache."""
        c = self.cfg
        if not c.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        if c.fused_gate_up:
            return self.down(self.gate_up_proj(x))
        gate, up = clamp_swiglu(self.gate_proj(x), self.up_proj(x), c.swiglu_limit)
        out = self.down_proj(self._act(gate).mul_(up))
        return out if c.down_multiplier == 1.0 else out * c.down_multiplier

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record this MLP, gated or not, without multipliers or clamp on x [rows, D] (model/capture.py); the
        builder says which activations it has."""
        require_type(self, MLP, f"layer {layer}: mixer")
        c = self.cfg
        if c.gate_multiplier != 1.0 or c.down_multiplier != 1.0:
            raise GraphUnsupportedError("an MLP with a gate or down multiplier")
        if c.swiglu_limit is not None or c.interleaved_gate_up:
            raise GraphUnsupportedError("an MLP with a SwiGLU clamp or interleaved gate/up rows")
        if not c.gated:
            act = builder.activation(c.activation, self.up_proj.capture_decode(builder, x))
            return self.down_proj.capture_decode(builder, act)
        i = c.intermediate_size
        if c.fused_gate_up:
            gate_up = self.gate_up_proj.capture_decode(builder, x)
            gate, up = gate_up[:, :i], gate_up[:, i:]
        else:
            gate, up = (p.capture_decode(builder, x) for p in (self.gate_proj, self.up_proj))
        return self.down_proj.capture_decode(builder, builder.activation(c.activation, gate, up))
