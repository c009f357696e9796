"""What one state slot holds for one recurrent layer: a tuple of named tensor specs.

Every recurrent layer kind declares its state as named tensors (without the slot dimension), each in the
model dtype or in a fixed dtype:
- Mamba1 / Mamba2: `conv` (the conv window) + `ssm` (the SSM state, fp32);
- Gated DeltaNet: `conv` + `recurrent` (the matrix state [H_v, D_k, D_v], fp32);
- a short-conv layer: `conv` alone; KDA: several conv windows + a matrix state.
The cache, copy-on-write, byte accounting and disaggregated transfer iterate over these specs and never
look at a layer's kind; the core sees a slot as one id and a byte size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTensorSpec:
    name: str  # unique within the layer ("conv", "ssm", "recurrent", ...)
    shape: tuple[int, ...]  # one slot's tensor, without the slot dimension
    dtype: torch.dtype | None = None  # None: the model dtype (conv windows); recurrent states pin fp32

    def __post_init__(self) -> None:
        if not self.name or "." in self.name:
            raise ValueError(f"state tensor name {self.name!r} must be non-empty and without '.'")
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"state tensor {self.name!r}: shape {self.shape} must have positive dims")

    def resolve_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.dtype is None else self.dtype

    def nbytes(self, model_dtype: torch.dtype) -> int:
        """Bytes of this tensor in one slot."""
        return math.prod(self.shape) * self.resolve_dtype(model_dtype).itemsize


def conv_window_spec(channels: int, kernel: int, name: str = "conv") -> StateTensorSpec:
    """The last K-1 inputs of a depthwise causal conv (the layout kernels/conv1d.py reads and writes)."""
    return StateTensorSpec(name, (channels, kernel - 1))


def check_specs(specs: tuple[StateTensorSpec, ...]) -> tuple[StateTensorSpec, ...]:
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"a recurrent layer needs >= 1 state tensor with distinct names, got {names}")
    return specs
