"""Sizing the KV block pool and the state pool from byte budgets."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from recap.config import CacheConfig, SchedulerConfig

# Share of available memory each pool takes when no byte budget is given.
DEFAULT_MEMORY_FRACTION = 0.15


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class PoolSizes:
    num_kv_blocks: int  # including the null block
    num_state_slots: int
    kv_bytes: int  # both attention groups (full and sliding-window)
    state_bytes: int
    num_window_blocks: int = 0  # the window group's pool, including its null block


@dataclass(frozen=True)
class MemoryPlan:
    """What a runner holds, for the start-up log: the weights, the native kernels' packed copies, the pools."""

    weight_bytes: int  # the model's parameters and buffers
    packed_bytes: int  # the copies of linear weights the native kernels read (panels, int8 tiles)
    pools: PoolSizes
    block_size: int
    # Speculative decoding's scratch state slots beside the pool (runner/speculative.py); 0 without speculation.
    num_scratch_slots: int = 0

    def describe(self) -> str:
        p = self.pools
        kv = "no KV pool (no attention layers)" if not p.num_kv_blocks else (
            f"KV pool {_mib(p.kv_bytes)} in {p.num_kv_blocks - 1} blocks of {self.block_size} tokens"
            + (f" (sliding-window group: {p.num_window_blocks - 1} blocks)" if p.num_window_blocks else ""))
        state = "no state pool (no recurrent layers)" if not p.num_state_slots else (
            f"state pool {_mib(p.state_bytes)} in {p.num_state_slots} slots of "
            f"{_mib(p.state_bytes // p.num_state_slots)}")
        packed = f" + {_mib(self.packed_bytes)} packed for the native kernels" if self.packed_bytes else ""
        if self.num_scratch_slots and p.num_state_slots:
            scratch = self.num_scratch_slots * (p.state_bytes // p.num_state_slots)
            state += f" + {self.num_scratch_slots} scratch slots for speculation ({_mib(scratch)})"
        return f"weights {_mib(self.weight_bytes)}{packed}; {kv}; {state}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n:,} B)"


def _split_device_budget(
    cache: CacheConfig, sched: SchedulerConfig, attn_bytes_per_token: int, state_bytes_per_slot: int, budget: int
) -> CacheConfig:
    """The cache config with byte budgets for the pools that have none, out of a GPU's `budget`."""
    state = cache.state_cache_bytes
    if state is None and state_bytes_per_slot:
        state = min(_state_want(sched, state_bytes_per_slot), budget // 2)
    kv = cache.kv_cache_bytes
    if kv is None and attn_bytes_per_token:
        kv = max(budget - (state or 0), 0)
    return replace(cache, kv_cache_bytes=kv, state_cache_bytes=state)


def _state_want(sched: SchedulerConfig, state_bytes_per_slot: int) -> int:
    """Running slots for every sequence plus room for checkpoints."""
    return (4 * sched.max_num_seqs + 64) * state_bytes_per_slot


def size_pools(
    cache: CacheConfig,
    sched: SchedulerConfig,
    kv_bytes_per_token: int,
    state_bytes_per_slot: int,
    available: int | None = None,
    window_bytes_per_token: int = 0,
    device_budget: int | None = None,
) -> PoolSizes:
    """Blocks and slots that fit the budgets; errors if the budgets cannot run one full-length request.

    With sliding-window layers the KV budget is split so both attention groups get the same number of
    blocks (the window group never runs out first; it frees blocks out of the window as requests run).
    device_budget: the bytes a GPU leaves the pools (runner/device.py); a pool without its own byte budget
    then takes what it wants up to half of it, the KV pool also what the state pool leaves.
    """
    if device_budget is not None:
        cache = _split_device_budget(cache, sched, kv_bytes_per_token + window_bytes_per_token,
                                     state_bytes_per_slot, device_budget)  # fmt: skip
    avail = available_memory_bytes() if available is None else available
    num_blocks = 0
    attn_bytes_per_token = kv_bytes_per_token + window_bytes_per_token
    if attn_bytes_per_token:
        block_bytes = attn_bytes_per_token * cache.block_size
        # Without a budget: enough for every sequence at full length, capped by a share of memory.
        want = (sched.max_num_seqs * sched.max_model_len // cache.block_size + 1) * block_bytes
        budget = cache.kv_cache_bytes or min(want, int(avail * DEFAULT_MEMORY_FRACTION))
        num_blocks = budget // block_bytes + 1
        need = -(-sched.max_model_len // cache.block_size) + 1
        if num_blocks < need:
            raise ValueError(
                f"KV cache budget {budget} B holds {num_blocks - 1} blocks; one {sched.max_model_len}-token "
                f"sequence needs {need - 1}: raise kv_cache_bytes or lower max_model_len"
            )
    num_slots = 0
    if state_bytes_per_slot:
        want = _state_want(sched, state_bytes_per_slot)
        budget = cache.state_cache_bytes or min(want, int(avail * DEFAULT_MEMORY_FRACTION))
        num_slots = budget // state_bytes_per_slot
        if num_slots < 2:
            raise ValueError(
                f"state cache budget {budget} B holds {num_slots} slots of {state_bytes_per_slot} B; need >= 2"
            )
    return PoolSizes(
        num_kv_blocks=num_blocks if kv_bytes_per_token else 0,
        num_state_slots=num_slots,
        kv_bytes=max(0, num_blocks - 1) * attn_bytes_per_token * cache.block_size,
        state_bytes=num_slots * state_bytes_per_slot,
        num_window_blocks=num_blocks if window_bytes_per_token else 0,
    )
