"""The torch backend: vLLM's --enforce-eager. Every step runs the model's modules with the reference kernel
set (TORCH_KERNELS) and torch's linear kernels (F.linear, oneDNN over a packed weight, or fbgemm's int8); no
native decode kernels, no captured steps, the weights where the loader put them."""

from __future__ import annotations

from typing import ClassVar

from recap.backends.base import Backend, model_parts, set_linear_backend, switch_native
from recap.kernels.kernel_set import TORCH_KERNELS
from recap.model.layers.linear import LINEAR_BACKENDS
from recap.model.models import CausalLM


class TorchBackend(Backend):
    """torch's kernels only; `linear_backend` is one of LINEAR_BACKENDS ("torch": the F.linear reference)."""

    name: ClassVar[str] = "torch"

    def __init__(self, linear_backend: str = "torch") -> None:
        if linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"unknown linear backend {linear_backend!r}; choose one of {LINEAR_BACKENDS}")
        self.linear_backend = linear_backend
        self.kernels = TORCH_KERNELS

    def _prepare(self, model: CausalLM) -> None:
        """The native kernels off, then every linear layer on `linear_backend` (int8: quantized here)."""
        parts = model_parts(model)
        switch_native(parts, False)
        set_linear_backend(parts, self.linear_backend)
