"""RWKV-4 (RwkvForCausalLM): attention-free, every layer a time mix + channel mix over the state kind "rwkv"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.model_config import ModelConfig
from recap.model.rwkv_config import RwkvConfig
from recap.model.translators.common import LINEAR_CHUNK, _common


def _rwkv(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    attention = cfg.get("attention_hidden_size")
    intermediate = cfg.get("intermediate_size")
    rwkv = RwkvConfig(
        hidden_size=hidden,
        attention_size=int(attention) if attention is not None else hidden,  # transformers' defaults
        intermediate_size=int(intermediate) if intermediate is not None else 4 * hidden,
        rescale_every=int(cfg.get("rescale_every", 6)),
    )
    common = _common(cfg, arch)
    context = cfg.get("context_length", cfg.get("max_position_embeddings"))
    common["max_position_embeddings"] = int(context) if context is not None else None  # the training length
    return ModelConfig(
        **common,
        layer_types=("rwkv",) * n,
        mlp_types=("none",) * n,  # the channel mix is part of the layer's state kind
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=LINEAR_CHUNK,
        rwkv=rwkv,
    )
