"""Helpers every translator shares: common fields, RoPE and attention settings, prefixed Mamba2 keys."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from recap.model.mixer_configs import AttentionConfig, Mamba2Config


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no translator (the message lists the supported ones), or uses a variant
    that its translator refuses."""


LINEAR_CHUNK = 64  # chunk grid of the short-conv and KDA kernels (the KDA chunk; conv cuts are free)


def _float(v: Any) -> float:
    """A float from config.json: plain numbers, bare Infinity, "Infinity", or {"__float__": "Infinity"}."""
    if isinstance(v, Mapping) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _time_step_limit(cfg: Mapping[str, Any]) -> tuple[float, float]:
    raw = cfg.get("time_step_limit")
    if raw is None:
        return (0.0, math.inf)
    lo, hi = raw
    return (_float(lo), _float(hi))


def _eos(cfg: Mapping[str, Any]) -> int | tuple[int, ...] | None:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else eos


def _common(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    return {
        "architecture": arch,
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": _eos(cfg),
        "pad_token_id": cfg.get("pad_token_id"),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


def _dt_rank(value: Any, hidden: int) -> int:
    return math.ceil(hidden / 16) if value in (None, "auto") else int(value)



def _attention(cfg: Mapping[str, Any], rope_theta: float | None, partial: float) -> AttentionConfig:
    heads = int(cfg["num_attention_heads"])
    kv = cfg.get("num_key_value_heads")
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    rotary = int(head_dim * partial) if rope_theta is not None else 0
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=int(kv) if kv is not None else heads,
        head_dim=int(head_dim),
        rope_theta=rope_theta,
        rotary_dim=rotary,
        bias=bool(cfg.get("attention_bias", False)),
    )


def _rope(cfg: Mapping[str, Any], arch: str, partial_default: float = 1.0) -> tuple[float, float]:
    """(theta, partial rotary factor) of a default (unscaled) RoPE; any other rope_type is refused."""
    rope = dict(cfg.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(f"{arch}: rope_type {rope['rope_type']!r} is not supported")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", partial_default)))


def _mamba2_prefixed(cfg: Mapping[str, Any], d_inner: int | None = None, **fields: Any) -> Mamba2Config:
    """The Mamba2 config of the hybrids that name it `mamba_*` (Bamba, Granite 4.0-H, Falcon-H1)."""
    heads = int(cfg.get("mamba_n_heads", 128))
    if d_inner is None:
        d_inner = int(cfg.get("mamba_expand", 2)) * int(cfg["hidden_size"])
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = d_inner // heads if d_head in (None, "auto") else int(d_head)
    args: dict[str, Any] = {
        "num_heads": heads,
        "head_dim": d_head,
        "n_groups": int(cfg.get("mamba_n_groups", 1)),
        "d_state": int(cfg.get("mamba_d_state", 256)),
        "d_conv": int(cfg.get("mamba_d_conv", 4)),
        "chunk_size": int(cfg.get("mamba_chunk_size", 256)),
        "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "proj_bias": bool(cfg.get("mamba_proj_bias", False)),
        "time_step_limit": _time_step_limit(cfg),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
        "activation": cfg.get("hidden_act", "silu"),
    }
    return Mamba2Config(**{**args, **fields})



def _pick(cfg: Mapping[str, Any], default: Any, *names: str) -> Any:
    """The first of `names` present in cfg (current name first, then legacy ones), else `default`."""
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


# Nemotron-H layer kinds: hybrid_override_pattern characters and layers_block_type names (current and legacy).

# Gated DeltaNet hybrids: the chunk grid the runner cuts GDN rows on (fla's and transformers' chunk size).
GDN_CHUNK = 64


def nested_text_config(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A multimodal wrapper's text model config (`text_config`), with the outer config's head tying and
    generation ids, which govern the whole checkpoint."""
    if not isinstance(cfg.get("text_config"), Mapping):
        raise ValueError(f"{arch}: config.json has no text_config")
    text = dict(cfg["text_config"])
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text
