"""Backends: how the runner executes a model on a device (base.py: the seam). The model package imports
nothing from here; the runner owns the backend it runs.

- TorchBackend (eager.py): the module path every step with one kernel set: torch's (vLLM's --enforce-eager), or
  the Triton kernels (a GPU, or a CPU under Triton's interpreter).
- CpuBackend (cpu.py): the CPU decode fast path: native kernels, weights and pools on huge pages, decode graphs.
- CudaBackend (cuda.py): the GPU path: the Triton kernels, decode steps replayed from CUDA graphs (cuda_graph.py).
"""

from __future__ import annotations

import torch

from recap.backends.base import Backend
from recap.backends.cpu import NATIVE_LIBRARIES, CpuBackend
from recap.backends.cuda import CudaBackend
from recap.backends.eager import TorchBackend
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.linear_rows import linear_rows_available
from recap.kernels.native import build_libraries
from recap.model.loader import LoadedModel


def backend_for(loaded: LoadedModel, device: str = "cpu", kernels: KernelSet = TORCH_KERNELS) -> Backend:
    """The backend a loaded model's flags (the output head's backend among them), the device and the kernel set
    ask for (not yet prepared): on a CPU with torch's kernels, the CPU fast path when `native_decode` is on, the
    linear backend is not the torch reference and the native kernels build here (else a warning said why, once);
    on a GPU, the module path with `kernels` (the Triton kernels, recap/kernels/triton/) and decode steps replayed
    from CUDA graphs (off with native_decode, --enforce-eager); otherwise the module path every step."""
    kind = torch.device(device).type
    if kind == "cpu" and kernels is TORCH_KERNELS and loaded.native_decode and loaded.linear_backend != "torch":
        build_libraries(NATIVE_LIBRARIES)  # all at once where none is cached yet (a new machine)
        if linear_rows_available():
            return CpuBackend(loaded.linear_backend, loaded.head_backend)
    if kind == "cuda" and loaded.native_decode:
        return CudaBackend(loaded.linear_backend, kernels, loaded.head_backend)
    return TorchBackend(loaded.linear_backend, kernels, loaded.head_backend)


def prepare(loaded: LoadedModel, device: str = "cpu", kernels: KernelSet = TORCH_KERNELS) -> Backend:
    """backend_for(loaded, device, kernels), with the loaded model prepared for it."""
    backend = backend_for(loaded, device, kernels)
    backend.prepare(loaded.model)
    return backend


__all__ = ["Backend", "CpuBackend", "CudaBackend", "TorchBackend", "backend_for", "prepare"]
