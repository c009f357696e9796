"""RecurrentGemma (RecurrentGemmaForCausalLM, Griffin): RG-LRU recurrent blocks + local sliding-window attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recap.model.feed_forward_configs import MLPConfig
from recap.model.mixer_configs import AttentionConfig
from recap.model.model_config import ModelConfig
from recap.model.rglru_config import RGLRUConfig
from recap.model.translators.common import LINEAR_CHUNK, _common, _rope

_KINDS = {"recurrent": "rglru", "attention": "attention"}


def _recurrent_gemma(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    pattern = list(cfg.get("block_types") or ("recurrent", "recurrent", "attention"))
    if not pattern or set(pattern) - set(_KINDS):
        raise ValueError(f"{arch}: block_types must name {sorted(_KINDS)}, got {pattern}")
    layer_types = tuple(_KINDS[pattern[i % len(pattern)]] for i in range(n))  # the pattern repeats, as in HF
    heads = int(cfg["num_attention_heads"])
    head_dim = hidden // heads  # transformers derives it so, whatever config.json says
    theta, partial = _rope(cfg, arch, partial_default=0.5)  # transformers' default factor for this family
    kv = cfg.get("num_key_value_heads")
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=int(kv) if kv is not None else heads, head_dim=head_dim, rope_theta=theta,
        rotary_dim=int(head_dim * partial), bias=bool(cfg.get("attention_bias", False)), o_bias=True,
    )  # fmt: skip
    act = str(cfg.get("hidden_activation", "gelu_pytorch_tanh"))
    window = int(cfg.get("attention_window_size", 2048))
    cap = cfg.get("logits_soft_cap", 30.0)  # transformers' default when config.json names none
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=("dense",) * n,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        ssm_chunk_size=LINEAR_CHUNK,
        # transformers scales the embeddings by sqrt(hidden) rounded to bfloat16 (its `normalizer` buffer)
        embedding_multiplier=float(torch.tensor(hidden**0.5, dtype=torch.bfloat16)),
        logits_soft_cap=float(cap) if cap is not None else None,
        attention=attention if "attention" in layer_types else None,
        mlp=MLPConfig(int(cfg["intermediate_size"]) // 2, activation=act, bias=True),  # HF halves it
        rglru=RGLRUConfig(int(cfg.get("lru_width") or hidden), heads, int(cfg.get("conv1d_width", 4)), act)
        if "rglru" in layer_types
        else None,
        attention_windows=tuple(window if k == "attention" else 0 for k in layer_types),
    )
