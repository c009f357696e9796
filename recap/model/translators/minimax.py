"""MiniMax (MiniMax-Text-01): lightning attention + softmax attention layers, a Mixtral-style MoE in each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MoEConfig
from recap.model.mixer_configs import LightningConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import UnsupportedArchitectureError, _attention, _common, _rope

_MINIMAX_KINDS = {"linear_attention": "lightning", "full_attention": "attention"}
_FACTORS = ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor",
            "linear_attn_beta_factor", "mlp_alpha_factor", "mlp_beta_factor")  # fmt: skip


def _minimax(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    # transformers' default when a config lists none: full attention at even layers, lightning at odd ones
    kinds = cfg.get("layer_types") or ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(n)]
    if not kinds or len(kinds) != n or set(kinds) - set(_MINIMAX_KINDS):
        raise ValueError(f"{arch}: layer_types must list {n} of {sorted(_MINIMAX_KINDS)}, got {kinds}")
    if cfg.get("sliding_window") is not None:
        raise UnsupportedArchitectureError(f"{arch}: sliding_window on the softmax attention layers")
    layer_types = tuple(_MINIMAX_KINDS[k] for k in kinds)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta = _rope(cfg, arch)[0]  # transformers' MiniMax rotates the whole head: no partial factor read
    act = cfg.get("hidden_act", "silu")
    moe = MoEConfig(  # softmax over all experts, top-k, renormalized (Mixtral's router)
        num_experts=int(cfg.get("num_local_experts", 8)),
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg["intermediate_size"]),
        activation=act,
        renormalize=True,
    )
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=("moe",) * n,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=64,
        attention=_attention({**cfg, "head_dim": head_dim}, theta, 1.0) if "attention" in layer_types else None,
        moe=moe,
        lightning=LightningConfig(heads, head_dim, n, activation=act) if "lightning" in layer_types else None,
        minimax_factors=tuple(float(cfg.get(f, 1.0)) for f in _FACTORS),  # type: ignore[arg-type]
    )
