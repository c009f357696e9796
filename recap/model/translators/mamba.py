"""Mamba, FalconMamba, Mamba2, and the first hybrids: Bamba (Mamba2 + attention), Jamba (Mamba1 + attention + MoE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import DEFAULT_MAMBA1_CHUNK, Mamba1Config, Mamba2Config
from recap.model.model_config import ModelConfig
from recap.model.translators.common import (
    _attention,
    _common,
    _dt_rank,
    _mamba2_prefixed,
    _rope,
    _time_step_limit,
)


def _mamba(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    falcon = arch == "FalconMambaForCausalLM"
    m1 = Mamba1Config(
        d_inner=int(cfg.get("expand", 2) * hidden),  # HF derives it, ignoring intermediate_size
        d_state=int(cfg.get("state_size", 16)),
        d_conv=int(cfg.get("conv_kernel", 4)),
        dt_rank=_dt_rank(cfg.get("time_step_rank", "auto"), hidden),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        activation=cfg.get("hidden_act", "silu"),
        bcdt_norm="plain" if falcon else "none",
        bcdt_norm_eps=float(cfg.get("mixer_rms_eps", 1e-6)),
    )
    n = int(cfg["num_hidden_layers"])
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=("mamba1",) * n,
        mlp_types=("none",) * n,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
        ssm_chunk_size=DEFAULT_MAMBA1_CHUNK,
        mamba1=m1,
    )


def _mamba2(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    heads, head_dim = int(cfg.get("num_heads", 128)), int(cfg.get("head_dim", 64))
    if heads * head_dim != int(cfg.get("expand", 2) * hidden):
        raise ValueError(f"num_heads * head_dim ({heads * head_dim}) != expand * hidden_size")
    m2 = Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        n_groups=int(cfg.get("n_groups", 8)),
        d_state=int(cfg.get("state_size", 128)),
        d_conv=int(cfg.get("conv_kernel", 4)),
        chunk_size=int(cfg.get("chunk_size", 256)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        time_step_limit=_time_step_limit(cfg),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        activation=cfg.get("hidden_act", "silu"),
    )
    n = int(cfg["num_hidden_layers"])
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=("mamba2",) * n,
        mlp_types=("none",) * n,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
        ssm_chunk_size=m2.chunk_size,
        mamba2=m2,
    )



def _bamba(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    theta, partial = _rope(cfg, arch, 0.5)  # BambaConfig hard-codes 0.5
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    m2 = _mamba2_prefixed(cfg)
    n = int(cfg["num_hidden_layers"])
    attn = set(cfg.get("attn_layer_indices") or ())
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=tuple("attention" if i in attn else "mamba2" for i in range(n)),
        mlp_types=("dense",) * n,
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=m2.chunk_size,
        attention=_attention(cfg, theta, partial),
        mlp=MLPConfig(
            intermediate_size=int(cfg["intermediate_size"]),
            activation=cfg.get("hidden_act", "silu"),
            bias=bool(cfg.get("mlp_bias", False)),
        ),
        mamba2=m2,
    )


def _jamba(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    attn_period, attn_offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    exp_period, exp_offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    num_experts = int(cfg.get("num_experts", 16))
    m1 = Mamba1Config(
        d_inner=int(cfg.get("mamba_expand", 2)) * hidden,
        d_state=int(cfg.get("mamba_d_state", 16)),
        d_conv=int(cfg.get("mamba_d_conv", 4)),
        dt_rank=_dt_rank(cfg.get("mamba_dt_rank", "auto"), hidden),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        activation=cfg.get("hidden_act", "silu"),
        bcdt_norm="weighted",
        bcdt_norm_eps=eps,
    )
    moe = tuple(num_experts > 1 and i % exp_period == exp_offset for i in range(n))
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=tuple("attention" if i % attn_period == attn_offset else "mamba1" for i in range(n)),
        mlp_types=tuple("moe" if m else "dense" for m in moe),
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=DEFAULT_MAMBA1_CHUNK,
        attention=_attention(cfg, None, 1.0),
        mlp=MLPConfig(intermediate_size=int(cfg["intermediate_size"]), activation=cfg.get("hidden_act", "silu")),
        moe=MoEConfig(  # softmax over all experts, top-k, weights not renormalized
            num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg["intermediate_size"]),
            activation=cfg.get("hidden_act", "silu"),
        )
        if any(moe)
        else None,
        mamba1=m1,
    )
