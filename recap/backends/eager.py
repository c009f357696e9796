"""The eager backend: every step runs the model's modules with one kernel set and torch's linear kernels (F.linear,
or oneDNN over a packed weight; int8 layers keep the native int8 kernel where it builds: its tiles are their one
copy of the weight, fbgemm's dynamic linear elsewhere); no decode graphs, no huge pages, the weights where the
loader put them. With the reference kernel set (TORCH_KERNELS) it is vLLM's --enforce-eager on a CPU; with
the Triton kernel set it runs a GPU eagerly (--enforce-eager; the CUDA backend, cuda.py, replays decode steps)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from recap.backends.base import Backend, model_parts, set_linear_backend, switch_native
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.model.layers.linear import LINEAR_BACKENDS
from recap.model.models import CausalLM


class TorchBackend(Backend):
    """`kernels` for the layers' ops; `linear_backend` is one of LINEAR_BACKENDS ("torch": the F.linear
    reference, the only one off the CPU); `head_backend` the output head's where it differs (LoadedModel's:
    int8 under int4, model/head_format.py; None: as the other linears)."""

    name: ClassVar[str] = "torch"

    def __init__(self, linear_backend: str = "torch", kernels: KernelSet = TORCH_KERNELS,
                 head_backend: str | None = None) -> None:  # fmt: skip
        for b in (linear_backend, head_backend or linear_backend):
            if b not in LINEAR_BACKENDS:
                raise ValueError(f"unknown linear backend {b!r}; choose one of {LINEAR_BACKENDS}")
        self.linear_backend, self.head_backend = linear_backend, head_backend
        self.kernels = kernels

    def layer_formats(self, model: CausalLM) -> dict[nn.Module, str]:
        """The layers whose backend is not `linear_backend`: set_linear_backend's `formats`."""
        return {} if self.head_backend is None else {model.head(): self.head_backend}

    def _prepare(self, model: CausalLM) -> None:
        """Every linear layer on `linear_backend` with the native kernels off (int8: quantized here unless the
        loader already did), then every other part's native kernels off."""
        parts = model_parts(model)
        set_linear_backend(parts, self.linear_backend, native=False, formats=self.layer_formats(model))
        switch_native(parts, False)
