"""Backends: how the runner executes a model on a device (base.py: the seam). The model package imports
nothing from here; the runner owns the backend it runs.

- TorchBackend (eager.py): torch's kernels only, the module path every step (vLLM's --enforce-eager).
- CpuBackend (cpu.py): the CPU decode fast path: native kernels, weights and pools on huge pages, decode graphs.
"""

from __future__ import annotations

from recap.backends.base import Backend
from recap.backends.cpu import CpuBackend
from recap.backends.eager import TorchBackend
from recap.kernels.linear_rows import linear_rows_available
from recap.model.loader import LoadedModel

DEVICES = ("cpu",)


def backend_for(loaded: LoadedModel, device: str = "cpu") -> Backend:
    """The backend a loaded model's flags ask for (not yet prepared): the CPU fast path when `native_decode`
    is on, the linear backend is not the torch reference and the native kernels build here (else a warning
    said why, once); the torch backend otherwise."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} has no backend; choose one of {DEVICES}")
    if loaded.native_decode and loaded.linear_backend != "torch" and linear_rows_available():
        return CpuBackend(loaded.linear_backend)
    return TorchBackend(loaded.linear_backend)


def prepare(loaded: LoadedModel, device: str = "cpu") -> Backend:
    """backend_for(loaded, device), with the loaded model prepared for it."""
    backend = backend_for(loaded, device)
    backend.prepare(loaded.model)
    return backend


__all__ = ["Backend", "CpuBackend", "TorchBackend", "backend_for", "prepare"]
