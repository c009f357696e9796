"""The memory plan `recap serve` logs at start-up: the weights as the checkpoint holds them, the pools as sized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from recap.config import CacheConfig, SchedulerConfig
from recap.model.loader import load_model
from recap.runner.model_runner import ModelRunner, RunnerConfig


def _checkpoint_bytes(folder: Path) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    return total


@pytest.mark.parametrize(("arch", "has_kv"), [("bamba", True), ("mamba2", False)])
def test_memory_plan_counts_weights_and_pools(
    tiny_checkpoint: Callable[[str], Path], arch: str, has_kv: bool
) -> None:
    folder = tiny_checkpoint(arch)
    runner = ModelRunner(load_model(folder, dtype=torch.float32, native_decode=False),
                         CacheConfig(block_size=16, kv_cache_bytes=3 << 20, state_cache_bytes=5 << 20),
                         SchedulerConfig(max_model_len=256), RunnerConfig())
    plan = runner.memory_plan()
    buffers = sum(b.nbytes for b in runner.model.buffers())  # computed at load (e.g. rotary tables)
    # A float32 checkpoint served in float32 holds one copy of each weight: the parameters left plus the linear
    # layers' own layouts (native decode off: oneDNN's packed copies, which released their parameters).
    assert plan.weight_bytes + plan.packed_bytes - buffers == _checkpoint_bytes(folder)
    p = plan.pools
    assert p.state_bytes == p.num_state_slots * runner.state_bytes_per_slot <= 5 << 20
    assert p.state_bytes + runner.state_bytes_per_slot > 5 << 20  # as many slots as fit
    text = plan.describe()
    assert f"weights {plan.weight_bytes / 2**20:.1f} MiB ({plan.weight_bytes:,} B)" in text
    assert f"in {p.num_state_slots} slots of" in text
    if has_kv:
        assert p.kv_bytes == (p.num_kv_blocks - 1) * 16 * runner.kv_bytes_per_token <= 3 << 20
        assert f"KV pool {p.kv_bytes / 2**20:.1f} MiB ({p.kv_bytes:,} B) in {p.num_kv_blocks - 1} blocks" in text
    else:
        assert p.kv_bytes == 0 and "no KV pool" in text
