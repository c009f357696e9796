"""vLLM's names for settings recap has under its own: dtype "auto" and `mamba_cache_mode`.

vLLM's `mamba_cache_mode` picks where a hybrid model's recurrent state is cached for prefix reuse;
its values are recap checkpoint policies of the same name (docs/design.md): "none" (no state is kept,
so no prefix hit on a model with recurrent layers), "align" (the state at the last block boundary
before the prompt's end), "all" (the state at every block boundary). recap adds "recap" (the
boundaries a later request can hit: segment ends, prompt ends and the branch points it learns), its
default.
"""

from __future__ import annotations

from recap.config import CHECKPOINT_POLICIES, CacheConfig
from recap.engine.config import DTYPES
from recap.runner.device import resolve_device

MAMBA_CACHE_MODES = ("none", "align", "all")
# dtype "auto": recap's CPU kernels run the model in float32 whatever the checkpoint stores; on a GPU, bfloat16
# (the recurrent states stay float32 either way: model/state_spec.py).
AUTO_DTYPE = "float32"
AUTO_GPU_DTYPE = "bfloat16"
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """vLLM's dtype names -> recap's; "auto" depends on the device ("auto", "cpu", "cuda[:N]")."""
    if dtype == "auto":
        return AUTO_GPU_DTYPE if resolve_device(device).type == "cuda" else AUTO_DTYPE
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    return name


def checkpoint_policy_for(checkpoint_policy: str | None, mamba_cache_mode: str | None) -> str:
    """The policy from recap's name or vLLM's (they must agree when both are given)."""
    if mamba_cache_mode is not None and mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {mamba_cache_mode!r}")
    if checkpoint_policy is not None and checkpoint_policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint_policy must be one of {CHECKPOINT_POLICIES}, got {checkpoint_policy!r}")
    if checkpoint_policy is not None and mamba_cache_mode is not None and checkpoint_policy != mamba_cache_mode:
        raise ValueError(f"checkpoint_policy {checkpoint_policy!r} and mamba_cache_mode {mamba_cache_mode!r} disagree")
    return checkpoint_policy or mamba_cache_mode or CacheConfig().checkpoint_policy
