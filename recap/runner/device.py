"""Where a runner computes: the device a model, its pools and its steps live on, and that device's memory.

`auto` is CUDA when torch sees a GPU, else the CPU. On a GPU the pools are sized as vLLM's
`--gpu-memory-utilization` sizes them: a share of the card's memory, less what the process already holds
once the weights are loaded, split between the KV and state pools.
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailableError(ValueError):
    """The device asked for cannot be used here (no GPU seen by torch, or a CPU-only torch build)."""


def resolve_device(name: str) -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a torch device that exists here; DeviceUnavailableError otherwise."""
    base = name.split(":", 1)[0]
    if base not in DEVICES or (base != "cuda" and ":" in name):
        raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {name!r}")
    if base == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if base == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DeviceUnavailableError(
            f"device {name!r}: torch {torch.__version__} ({build}) sees no CUDA GPU; use --device cpu"
        )
    device = torch.device(name)
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise DeviceUnavailableError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device("cuda", index)


def device_pool_budget(device: torch.device, memory_utilization: float) -> int | None:
    """Bytes the pools may take on `device`: `memory_utilization` of the card less what is in use now (the
    weights, torch's context). None on a CPU (pools are sized from the host's available memory)."""
    if device.type != "cuda":
        return None
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * memory_utilization) - (total - free)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {memory_utilization}: {total - free} B of {total} B are already in use "
            "(the weights and other processes); nothing is left for the KV and state pools"
        )
    return budget
