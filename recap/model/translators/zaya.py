"""Zaya (ZayaForCausalLM): every layer a "cca_attention" layer (compressed convolutional attention, full or
sliding, each kind with its own RoPE) followed by a top-1 MoE with a skip expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MoEConfig
from recap.model.mixer_configs import AttentionConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import LINEAR_CHUNK, UnsupportedArchitectureError, _common
from recap.model.zaya_config import CCAConfig

_KINDS = ("hybrid", "hybrid_sliding")
# transformers' defaults per layer kind: (rope_theta, partial_rotary_factor)
_ROPE = {"hybrid": (5_000_000.0, 0.5), "hybrid_sliding": (10_000.0, 0.5)}


def _attention(cfg: Mapping[str, Any], arch: str, kind: str, head_dim: int) -> AttentionConfig:
    params = (cfg.get("rope_parameters") or {}).get(kind)
    theta, partial = _ROPE[kind]
    if isinstance(params, Mapping):
        if params.get("rope_type", "default") != "default":
            raise UnsupportedArchitectureError(f"{arch}: rope_type {params['rope_type']!r} is not supported")
        theta = float(params.get("rope_theta", theta))
        partial = float(params.get("partial_rotary_factor", partial))
    heads = int(cfg.get("num_attention_heads", 8))
    return AttentionConfig(
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", 2)), head_dim=head_dim,
        rope_theta=theta, rotary_dim=int(head_dim * partial), bias=bool(cfg.get("attention_bias", False)),
    )  # fmt: skip


def _zaya(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    kinds = list(cfg.get("layer_types") or ["hybrid"] * n)
    if len(kinds) != n or set(kinds) - set(_KINDS):
        raise UnsupportedArchitectureError(f"{arch}: layer_types {kinds}")
    if int(cfg.get("num_experts_per_tok", 1)) != 1 or cfg.get("lm_head_bias", False):
        raise UnsupportedArchitectureError(f"{arch}: one expert per token and no lm_head bias (as transformers)")
    if str(cfg.get("hidden_act", "silu")) != "silu":
        raise UnsupportedArchitectureError(f"{arch}: hidden_act {cfg.get('hidden_act')!r} (silu experts only)")
    window = cfg.get("sliding_window")
    if "hybrid_sliding" in kinds and window is None:
        raise UnsupportedArchitectureError(f"{arch}: sliding layers need sliding_window")
    head_dim = int(cfg.get("head_dim", 128))
    full, swa = (_attention(cfg, arch, k, head_dim) for k in _KINDS)
    cca = CCAConfig(
        hidden_size=int(cfg["hidden_size"]), num_heads=full.num_heads, num_kv_heads=full.num_kv_heads,
        head_dim=head_dim, depthwise_kernel=int(cfg.get("cca_time0", 2)), grouped_kernel=int(cfg.get("cca_time1", 2)),
        router_hidden_size=int(cfg.get("router_hidden_size", 256)),
    )  # fmt: skip
    moe = MoEConfig(num_experts=int(cfg.get("num_experts", 16)), top_k=1,
                    intermediate_size=int(cfg.get("moe_intermediate_size", 2048)), expert_layout="stacked")  # fmt: skip
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=("cca_attention",) * n,
        mlp_types=("moe",) * n,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        ssm_chunk_size=LINEAR_CHUNK,
        residual_in_fp32=True,
        attention=full,
        layer_attention=tuple(swa if k == "hybrid_sliding" else None for k in kinds),
        attention_windows=tuple(int(window) if k == "hybrid_sliding" else 0 for k in kinds)
        if "hybrid_sliding" in kinds else (),
        moe=moe,
        cca=cca,
    )
