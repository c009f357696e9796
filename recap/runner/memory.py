"""The memory plan: the KV block pool and the state pool sized from byte budgets, the weights, the runtime
overhead, and the check that it all fits the memory the process may hold (refused before allocating)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from recap.config import CacheConfig, SchedulerConfig
from recap.model.footprint import prefill_activation_bytes, serving_weight_bytes_lower_bound, widest_linear
from recap.model.loader import build_model
from recap.model.model_config import ModelConfig
from recap.model.quant import QUANTIZATIONS
from recap.runner.host_memory import MemoryLimit, MemoryPlanError, available_memory_bytes, gib

# Share of available memory each pool takes when no byte budget is given.
DEFAULT_MEMORY_FRACTION = 0.15


@dataclass(frozen=True)
class PoolSizes:
    num_kv_blocks: int  # including the null block
    num_state_slots: int
    kv_bytes: int  # both attention groups (full and sliding-window)
    state_bytes: int
    num_window_blocks: int = 0  # the window group's pool, including its null block


# What the process holds beyond weights and pools, stated: the interpreter, torch and its libraries, the
# tokenizer, the native kernels and the allocator's slack (0.35-0.45 GiB of RSS before a model loads here),
# plus a step's live activations (model/footprint.py's prefill_activation_bytes).
RUNTIME_OVERHEAD_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """What a runner holds, for the start-up log and the refusal: the weights (measured, or before loading a
    lower bound), the linear layers' copies beside them, the pools, the runtime overhead, against the limit."""

    weight_bytes: int  # the model's parameters and buffers (a layer in its own layout released its weight)
    packed_bytes: int  # what the linear layers hold beside them (their own layouts: packed, quantized, panels)
    pools: PoolSizes
    block_size: int
    overhead_bytes: int = 0  # RUNTIME_OVERHEAD_BYTES + a step's activations
    limit: MemoryLimit | None = None  # the memory this process may hold (None: not checked)
    weight_format: str = ""  # e.g. "float32", "bfloat16 + int8 linear weights"
    before_load: bool = False  # weight_bytes is a lower bound from the config (nothing loaded yet)
    # Speculative decoding's scratch state slots beside the pool (runner/speculative.py); 0 without speculation.
    num_scratch_slots: int = 0
    # The draft model of speculative method "draft_model" (runner/draft_model.py): its weights and pools.
    draft_bytes: int = 0
    # What the backend's captured decode steps will hold (Backend.graph_bytes: estimated before capture).
    graph_bytes: int = 0
    # The host-memory cache tier's budget where it shares the plan's memory (a CPU's process memory).
    host_tier_bytes: int = 0

    @property
    def scratch_bytes(self) -> int:
        p = self.pools
        return self.num_scratch_slots * (p.state_bytes // p.num_state_slots) if p.num_state_slots else 0

    @property
    def total_bytes(self) -> int:
        p = self.pools
        return (self.weight_bytes + self.packed_bytes + p.kv_bytes + p.state_bytes + self.scratch_bytes
                + self.overhead_bytes + self.draft_bytes + self.graph_bytes + self.host_tier_bytes)

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total_bytes <= self.limit.bytes

    def describe(self) -> str:
        p = self.pools
        kv = "no KV pool (no attention layers)" if not p.num_kv_blocks else (
            f"KV pool {_mib(p.kv_bytes)} in {p.num_kv_blocks - 1} blocks of {self.block_size} tokens"
            + (f" (sliding-window group: {p.num_window_blocks - 1} blocks)" if p.num_window_blocks else ""))
        state = "no state pool (no recurrent layers)" if not p.num_state_slots else (
            f"state pool {_mib(p.state_bytes)} in {p.num_state_slots} slots of "
            f"{_mib(p.state_bytes // p.num_state_slots)}")
        packed = (f" + {_mib(self.packed_bytes)} in the linear layers' own copies (packed, quantized, native)"
                  if self.packed_bytes else "")
        fmt = f" in {self.weight_format}" if self.weight_format else ""
        if self.scratch_bytes:
            state += f" + {self.num_scratch_slots} scratch slots for speculation ({_mib(self.scratch_bytes)})"
        text = f"weights {_mib(self.weight_bytes)}{fmt}{packed}; {kv}; {state}"
        if self.overhead_bytes:
            text += f"; runtime overhead {_mib(self.overhead_bytes)}"
        if self.draft_bytes:
            text += f"; draft model {_mib(self.draft_bytes)} (weights and pools)"
        if self.graph_bytes:
            text += f"; decode graphs {_mib(self.graph_bytes)}"
        if self.host_tier_bytes:
            text += f"; host cache tier {_mib(self.host_tier_bytes)}"
        if self.limit is not None:
            text += f"; total {gib(self.total_bytes)} of {gib(self.limit.bytes)} ({self.limit.source})"
        return text

    def check(self, remedies: str = "") -> None:
        """Raise MemoryPlanError naming every figure when the total does not fit the limit."""
        if self.fits:
            return
        assert self.limit is not None
        p = self.pools
        weights = f"weights {'at least ' if self.before_load else ''}{gib(self.weight_bytes)}"
        if self.weight_format:
            weights += f" in {self.weight_format}"
        if self.packed_bytes:
            weights += f" + linear layers' copies {gib(self.packed_bytes)}"
        raise MemoryPlanError(
            f"not enough memory to serve this model{' (refused before loading it)' if self.before_load else ''}: "
            f"it needs {gib(self.total_bytes)} ({weights} + KV pool {gib(p.kv_bytes)} + state pool "
            f"{gib(p.state_bytes + self.scratch_bytes)} + runtime overhead {gib(self.overhead_bytes)} + draft model "
            f"{gib(self.draft_bytes)} + decode graphs {gib(self.graph_bytes)} + host cache tier "
            f"{gib(self.host_tier_bytes)}) but this "
            f"process may hold {gib(self.limit.bytes)} ({self.limit.source}). "
            + (remedies or "Lower the pools (kv_cache_bytes, state_cache_bytes) or the weights (dtype, quantization).")
        )


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


# The pools' default share is taken of what the weights and runtime leave, but of no less than this.
MIN_POOL_SHARE_BASE = 1 << 30


def pool_share_base(limit: MemoryLimit, weight_bytes: int, overhead_bytes: int) -> int:
    """The memory a pool without a byte budget takes its DEFAULT_MEMORY_FRACTION of: what the weights and the
    runtime leave of the limit."""
    return max(limit.bytes - weight_bytes - overhead_bytes, MIN_POOL_SHARE_BASE)


def weight_format(dtype: torch.dtype, quantization: str | None, head: str | None = None) -> str:
    """The weights' format in words; `head`: the output head's backend where it is not `quantization`'s."""
    name = str(dtype).removeprefix("torch.")
    if quantization is None:
        return name
    return f"{name} + {quantization} linear weights" + ("" if head in (None, quantization) else f", {head} head")


def remedies(dtype: torch.dtype, quantization: str | None, plan: MemoryPlan) -> str:
    """What to change to fit `plan`, in the CLI's flags and LLM's keywords."""
    ways = []
    if plan.pools.kv_bytes or plan.pools.state_bytes:
        ways.append("smaller pools (--kv-cache-bytes / kv_cache_bytes, --state-cache-bytes / state_cache_bytes)")
    if plan.host_tier_bytes:
        ways.append("a smaller host cache tier (--cache-host-bytes / cache_host_bytes)")
    if dtype == torch.float32:
        ways.append("bfloat16 weights (--dtype bfloat16)")
    if quantization is None:
        ways.append(f"quantized linear weights (--quantization {' or '.join(QUANTIZATIONS)})")
    ways.append("a machine or container with more memory")
    return "To serve it, use " + ", or ".join(ways) + "."


def plan_before_load(
    config: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype, quantization: str | None,
    limit: MemoryLimit, head: str | None = None,
) -> MemoryPlan:
    """The plan from the model's config alone (built on the meta device: no weight read): the weights' lower
    bound in the serving format (the output head at `head`'s width: model/head_format.py), the pools as the
    runner will size them, the runtime overhead."""
    meta = build_model(config, dtype, "meta")
    weights = serving_weight_bytes_lower_bound(meta, quantization, head)
    overhead = RUNTIME_OVERHEAD_BYTES + prefill_activation_bytes(
        sched.max_num_batched_tokens, widest_linear(meta, config.vocab_size))
    host_tier = cache.cache_host_bytes or 0
    pools = size_pools(
        cache, sched, config.kv_bytes_per_token(dtype), config.state_bytes_per_slot(dtype),
        available=pool_share_base(limit, weights, overhead + host_tier),
        window_bytes_per_token=config.window_bytes_per_token(dtype),
    )  # fmt: skip
    return MemoryPlan(weights, 0, pools, cache.block_size, overhead, limit, weight_format(dtype, quantization, head),
                      before_load=True, host_tier_bytes=host_tier)  # fmt: skip
