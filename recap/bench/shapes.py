"""Named model shapes for replay: cache bytes per token / per slot and prefill FLOPs, in plain numbers.

Definitions
- state_bytes_per_slot: one checkpoint (or running slot): conv + SSM state of every SSM layer.
- kv_bytes_per_token: K and V of every attention layer for one token.
- prefill FLOPs of tokens [start, end): `2 * num_params` per token (the matmuls) plus attention scores
  and values, `4 * attn_dim` per attention layer per earlier token (QK^T and AV), where `attn_dim` is
  heads * head_dim. Summed in closed form, so a step's cost is O(1) per request.
- budgets: byte sizes with a unit suffix, decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recap.config import CacheLayout


@dataclass(frozen=True)
class ModelShape:
    name: str
    description: str
    num_attention_layers: int
    num_ssm_layers: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    num_params: float  # for the 2 * params FLOPs per token
    attn_dim: int  # heads * head_dim of one attention layer (query side)

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.num_params

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to compute tokens at positions start..end-1 given the first `start` are cached."""
        n = end - start
        if n <= 0:
            return 0.0
        positions_sum = (start + end - 1) * n / 2.0  # each token attends to its earlier tokens
        return self.linear_flops_per_token * n + 4.0 * self.attn_dim * self.num_attention_layers * positions_sum

    def layout(self, block_size: int, num_kv_blocks: int, num_state_slots: int) -> CacheLayout:
        return CacheLayout(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            num_state_slots=num_state_slots,
            has_kv=self.num_attention_layers > 0,
            has_state=self.num_ssm_layers > 0,
            kv_bytes_per_token=self.kv_bytes_per_token,
            state_bytes_per_slot=self.state_bytes_per_slot,
            flops_per_token=self.linear_flops_per_token,
        )


def mamba2_state_bytes(
    d_model: int, d_state: int, n_groups: int = 1, expand: int = 2, d_conv: int = 4, dtype_bytes: int = 2
) -> int:
    """Bytes of one Mamba2 layer's state: conv window (d_conv columns, as mamba_ssm keeps it) + SSM state."""
    d_inner = expand * d_model
    conv = (d_inner + 2 * n_groups * d_state) * d_conv
    ssm = d_inner * d_state  # nheads * headdim * d_state
    return (conv + ssm) * dtype_bytes


def _hybrid_7b() -> ModelShape:
    d_model, n_ssm, n_attn, dtype_bytes = 4096, 24, 4, 2
    return ModelShape(
        name="hybrid-7b",
        description="7B hybrid: 24 Mamba2 + 4 attention layers (32 heads x 128), d_model 4096, fp16",
        num_attention_layers=n_attn,
        num_ssm_layers=n_ssm,
        kv_bytes_per_token=n_attn * 2 * d_model * dtype_bytes,  # 64 KiB
        state_bytes_per_slot=n_ssm * mamba2_state_bytes(d_model, d_state=64, dtype_bytes=dtype_bytes),
        num_params=7e9,
        attn_dim=d_model,
    )


def shape_from_model_config(cfg: Any, name: str, dtype_name: str = "float32") -> ModelShape:
    """A ModelShape from a recap.model.config.ModelConfig, sized as the model runner sizes its pools."""
    import torch  # lazy: the bench needs torch only for this shape

    dtype = getattr(torch, dtype_name)
    attn = cfg.attention
    return ModelShape(
        name=name,
        description=f"{cfg.architecture}: {len(cfg.ssm_layers)} SSM + {len(cfg.attention_layers)} "
        f"attention layers, hidden {cfg.hidden_size}, {dtype_name}",
        num_attention_layers=len(cfg.attention_layers),
        num_ssm_layers=len(cfg.ssm_layers),
        kv_bytes_per_token=cfg.kv_bytes_per_token(dtype),
        state_bytes_per_slot=cfg.state_bytes_per_slot(dtype) if cfg.has_ssm else 0,  # as the runner sizes it
        num_params=cfg.flops_per_token() / 2.0,
        attn_dim=attn.num_heads * attn.head_dim if attn is not None else 0,
    )


class ShapeUnavailable(RuntimeError):
    """A named shape exists but cannot be built in this checkout."""


def _default_shape() -> ModelShape:
    try:
        from recap.model.config import load_config
        from recap.model.default_model import ensure_random_model
    except ImportError as e:
        raise ShapeUnavailable(
            "model shape 'default' needs recap.model.config (load_config) and "
            f"recap.model.default_model (ensure_random_model), which are not importable: {e}"
        ) from e
    return shape_from_model_config(load_config(ensure_random_model()), "default")


SHAPES: dict[str, Callable[[], ModelShape]] = {"hybrid-7b": _hybrid_7b, "default": _default_shape}


def get_shape(name: str) -> ModelShape:
    try:
        factory = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}") from None
    return factory()


def kv_blocks_for_bytes(shape: ModelShape, nbytes: int, block_size: int) -> int:
    """KV blocks that fit in `nbytes`, plus the null block 0."""
    return nbytes // (shape.kv_bytes_per_token * block_size) + 1


def state_slots_for_bytes(shape: ModelShape, nbytes: int) -> int:
    return nbytes // shape.state_bytes_per_slot


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
