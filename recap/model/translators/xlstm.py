"""xLSTM (xLSTMForCausalLM): attention-free, every layer an mLSTM cell + a gated feed-forward (state kind "mlstm").
The kernel choices of config.json (chunkwise_kernel, sequence_kernel, step_kernel, mode, chunk_size,
autocast_kernel_dtype) pick how transformers computes the same cell, not what it computes: they are not read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.model_config import ModelConfig
from recap.model.translators.common import LINEAR_CHUNK, UnsupportedArchitectureError, _common
from recap.model.xlstm_config import WEIGHT_MODES, XlstmConfig


def _round_up(x: float, multiple: int) -> int:
    return int(((x + multiple - 1) // multiple) * multiple)  # transformers' round_up_to_next_multiple_of


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


def _xlstm(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden = int(cfg.get("hidden_size") or cfg["embedding_dim"])
    n = int(cfg.get("num_blocks") or cfg["num_hidden_layers"])  # transformers builds num_blocks blocks
    mode = cfg.get("weight_mode", "single")
    if mode not in WEIGHT_MODES:
        raise UnsupportedArchitectureError(f"{arch}: weight_mode {mode!r} (transformers defines {WEIGHT_MODES})")
    heads = int(cfg.get("num_heads", 8))
    qk, v = int(hidden * float(cfg.get("qk_dim_factor", 0.5))), int(hidden * float(cfg.get("v_dim_factor", 1.0)))
    if qk % heads or v % heads:
        raise UnsupportedArchitectureError(f"{arch}: qk width {qk} / value width {v} not divisible by {heads} heads")
    norm_eps = float(cfg.get("norm_eps", 1e-6))
    ffn = _round_up(hidden * float(cfg.get("ffn_proj_factor", 2.667)), int(cfg.get("ffn_round_up_to_multiple_of", 64)))
    xlstm = XlstmConfig(
        num_heads=heads, qk_dim=qk, v_dim=v, ffn_size=ffn,
        weight_mode=mode, use_bias=bool(cfg.get("use_bias", False)), gate_soft_cap=_cap(cfg.get("gate_soft_cap", 15.0)),
        eps=float(cfg.get("eps", 1e-6)), norm_eps=norm_eps,
        force_float32_norm=bool(cfg.get("norm_reduction_force_float32", True)),
    )  # fmt: skip
    common = _common({**cfg, "hidden_size": hidden}, arch)
    return ModelConfig(
        **common,
        layer_types=("mlstm",) * n,
        mlp_types=("none",) * n,  # the feed-forward is part of the layer (its config carries its width)
        norm_eps=norm_eps,
        tie_word_embeddings=False,  # transformers' xLSTM never ties: lm_head.weight is its own, whatever the flag
        ssm_chunk_size=LINEAR_CHUNK,
        logits_soft_cap=_cap(cfg.get("output_logit_soft_cap", 30.0)),
        xlstm=xlstm,
    )
