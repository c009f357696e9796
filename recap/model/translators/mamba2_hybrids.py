"""The Mamba2 hybrids people deploy: Nemotron-H, Granite 4.0-H, Falcon-H1, Zamba2; and Zamba (v1, Mamba1)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import DEFAULT_MAMBA1_CHUNK, AttentionConfig, Mamba2Config, MultiHeadMamba1Config
from recap.model.model_config import ModelConfig, SharedBlocksConfig
from recap.model.translators.common import (
    UnsupportedArchitectureError,
    _attention,
    _common,
    _mamba2_prefixed,
    _pick,
    _rope,
    nested_text_config,
)

_NEMOTRON_PATTERN = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
_NEMOTRON_KINDS = {"mamba": ("mamba2", "none"), "linear_attention": ("mamba2", "none"),
                   "attention": ("attention", "none"), "full_attention": ("attention", "none"),
                   "mlp": ("none", "dense"), "moe": ("none", "moe")}  # fmt: skip


def _nemotron_h(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None:
        pattern = cfg.get("hybrid_override_pattern") or ""
        if not pattern or set(pattern) - set(_NEMOTRON_PATTERN):
            raise ValueError(f"{arch}: bad hybrid_override_pattern {pattern!r} (characters M, E, *, -)")
        kinds = [_NEMOTRON_PATTERN[c] for c in pattern]
    if set(kinds) - set(_NEMOTRON_KINDS):
        raise ValueError(f"{arch}: unknown layer kinds {sorted(set(kinds) - set(_NEMOTRON_KINDS))}")
    layer_types, mlp_types = zip(*(_NEMOTRON_KINDS[k] for k in kinds))
    mtp_layers, mtp_mlps = _nemotron_mtp(cfg, arch)
    eps, act = float(cfg.get("layer_norm_epsilon", 1e-5)), cfg.get("mlp_hidden_act", "relu2")
    m2 = Mamba2Config(
        num_heads=int(cfg.get("mamba_num_heads", 128)),
        head_dim=int(cfg.get("mamba_head_dim", 64)),
        n_groups=int(_pick(cfg, 8, "n_groups", "mamba_n_groups")),
        d_state=int(cfg.get("ssm_state_size", 128)),
        d_conv=int(_pick(cfg, 4, "conv_kernel", "mamba_d_conv")),
        chunk_size=int(_pick(cfg, 128, "chunk_size", "mamba_chunk_size")),
        conv_bias=bool(_pick(cfg, True, "use_conv_bias", "mamba_conv_bias")),
        proj_bias=bool(cfg.get("use_bias", False)),
        # transformers' NemotronH clamps dt to [time_step_min, inf) and ignores time_step_limit.
        time_step_limit=(float(_pick(cfg, 0.001, "time_step_min", "mamba_dt_min")), math.inf),
        norm_eps=eps,
        activation=cfg.get("mamba_hidden_act", "silu"),
    )
    experts = int(_pick(cfg, 8, "n_routed_experts", "num_local_experts"))
    moe = MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg.get("moe_intermediate_size", 7688)),
        activation=act,
        gated=False,
        shared_bias=bool(cfg.get("mlp_bias", False)),
        scoring="sigmoid",
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        correction_bias=True,
        num_groups=int(cfg.get("n_group", 1)),
        topk_groups=int(cfg.get("topk_group", 1)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)),
        latent_size=cfg.get("moe_latent_size"),
    )
    attn = dataclasses.replace(_attention(cfg, None, 1.0), bias=False)  # transformers builds it without bias
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=mlp_types,
        norm_eps=eps,
        tie_word_embeddings=False,  # transformers' NemotronH never ties: lm_head is its own weight on disk

        ssm_chunk_size=m2.chunk_size,
        attention=attn if "attention" in (*layer_types, *mtp_layers) else None,
        mlp=MLPConfig(int(cfg.get("intermediate_size", 21504)), act, bool(cfg.get("mlp_bias", False)), gated=False),
        moe=moe if "moe" in (*mlp_types, *mtp_mlps) else None,
        mamba2=m2 if "mamba2" in (*layer_types, *mtp_layers) else None,
        mtp_layer_types=mtp_layers,
        mtp_mlp_types=mtp_mlps,
    )


def _nemotron_mtp(cfg: Mapping[str, Any], arch: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The blocks of one step of the `mtp.*` head (layer types, mlp types) where `num_nextn_predict_layers` > 0:
    `mtp_layers_block_type` (transformers' default: attention, then a MoE), or the legacy pattern string."""
    if int(cfg.get("num_nextn_predict_layers") or 0) <= 0:
        return (), ()
    kinds = cfg.get("mtp_layers_block_type")
    if kinds is None and cfg.get("mtp_hybrid_override_pattern"):
        pattern = cfg["mtp_hybrid_override_pattern"]
        if set(pattern) - set(_NEMOTRON_PATTERN):
            raise ValueError(f"{arch}: bad mtp_hybrid_override_pattern {pattern!r} (characters M, E, *, -)")
        kinds = [_NEMOTRON_PATTERN[c] for c in pattern]
    kinds = kinds or ["full_attention", "moe"]
    if set(kinds) - set(_NEMOTRON_KINDS):
        raise ValueError(f"{arch}: unknown MTP layer kinds {sorted(set(kinds) - set(_NEMOTRON_KINDS))}")
    layers, mlps = zip(*(_NEMOTRON_KINDS[k] for k in kinds))
    return tuple(layers), tuple(mlps)


def _nemotron_h_omni(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Nemotron-3 Nano Omni: the NemotronH text model of its `text_config` (`llm_config` in the released
    checkpoints' configs, which predate transformers' name), loaded text-only."""
    if "text_config" not in cfg and isinstance(cfg.get("llm_config"), Mapping):
        cfg = {**cfg, "text_config": cfg["llm_config"]}
    return _nemotron_h(nested_text_config(cfg, arch), arch)


_GRANITE_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2",
                  "attention": "attention", "full_attention": "attention"}  # fmt: skip


def _granite_moe_hybrid(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    if len(kinds) != n or set(kinds) - set(_GRANITE_KINDS):
        raise ValueError(f"{arch}: layer_types must list {n} of {sorted(_GRANITE_KINDS)}, got {kinds}")
    layer_types = tuple(_GRANITE_KINDS[k] for k in kinds)
    act = cfg.get("hidden_act", "silu")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope", "nope"):
        raise UnsupportedArchitectureError(f"{arch}: position_embedding_type {rope!r} is not supported")
    theta, partial = _rope(cfg, arch) if rope == "rope" else (None, 1.0)
    attn = dataclasses.replace(_attention(cfg, theta, partial), scale=float(cfg.get("attention_multiplier", 1.0)))
    experts = int(cfg.get("num_local_experts") or 0)
    moe = None
    if experts:  # softmax over the top-k logits == softmax over all, top-k, renormalized
        moe = MoEConfig(experts, int(cfg.get("num_experts_per_tok", 2)), int(cfg["intermediate_size"]), act,
                        renormalize=True, expert_layout="stacked")  # fmt: skip
    m2 = _mamba2_prefixed(cfg)
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=("moe" if experts else "dense",) * n,  # "moe": the MoE plus the shared MLP
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=m2.chunk_size,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_multiplier=1.0 / float(cfg.get("logits_scaling", 1.0)),
        attention=attn if "attention" in layer_types else None,
        mlp=MLPConfig(int(cfg.get("shared_intermediate_size", 1024)), act, fused_gate_up=True),  # the shared MLP
        moe=moe,
        mamba2=m2 if "mamba2" in layer_types else None,
    )


def _falcon_h1(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    theta, partial = _rope(cfg, arch)
    attn = _attention(cfg, theta, partial)
    attn = dataclasses.replace(
        attn,
        scale=attn.head_dim**-0.5 * float(cfg.get("key_multiplier", 1.0)),  # k * m, folded into the scale
        input_multiplier=float(cfg.get("attention_in_multiplier", 1.0)),
        output_multiplier=float(cfg.get("attention_out_multiplier", 1.0)),
    )
    rms_norm, before_gate = bool(cfg.get("mamba_rms_norm", False)), bool(cfg.get("mamba_norm_before_gate", True))
    d_ssm = cfg.get("mamba_d_ssm")
    m2 = _mamba2_prefixed(
        cfg,
        d_inner=int(d_ssm) if d_ssm is not None else int(cfg.get("mamba_expand", 2)) * hidden,
        gate_norm=("rmsnorm_gate" if before_gate else "gated_rmsnorm") if rms_norm else "gate",
        input_multiplier=float(cfg.get("ssm_in_multiplier", 1.0)),
        in_proj_multipliers=tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5),
        output_multiplier=float(cfg.get("ssm_out_multiplier", 1.0)),
        out_proj_bias=bool(cfg.get("projectors_bias", False)),
    )
    gate_m, down_m = (float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    mlp = MLPConfig(int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu"), bool(cfg.get("mlp_bias", False)),
                    gate_multiplier=gate_m, down_multiplier=down_m)  # fmt: skip
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=("hybrid",) * n,  # attention and Mamba2 side by side in every layer
        mlp_types=("dense",) * n,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=m2.chunk_size,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_multiplier=float(cfg.get("lm_head_multiplier", 1.0)),
        attention=attn,
        mlp=mlp,
        mamba2=m2,
    )

_ZAMBA2_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "hybrid": "hybrid"}


def _shared_attention(cfg: Mapping[str, Any], hidden: int, theta: float | None) -> AttentionConfig:
    """Zamba's and Zamba2's shared block attends over [h | embeddings], 2 * hidden wide."""
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = int(cfg.get("attention_head_dim") or 2 * hidden // heads)
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=head_dim if theta is not None else 0,
        scale=(head_dim / 2) ** -0.5,  # transformers' Zamba and Zamba2 scale by sqrt(head_dim / 2)
        input_size=int(cfg.get("attention_hidden_size") or 2 * hidden),
    )


def _zamba2(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not kinds or len(kinds) != n or set(kinds) - set(_ZAMBA2_KINDS):
        raise ValueError(f"{arch}: layers_block_type must list {n} of {sorted(_ZAMBA2_KINDS)}, got {kinds}")
    layer_types = tuple(_ZAMBA2_KINDS[k] for k in kinds)
    attn = _shared_attention(cfg, hidden, _rope(cfg, arch)[0] if cfg.get("use_mem_rope") else None)
    n_heads = int(cfg.get("n_mamba_heads", 8))
    m2 = Mamba2Config(  # transformers' Zamba2 fixes the conv bias, the activation, the norm eps and dt's floor
        num_heads=n_heads,
        head_dim=int(cfg.get("mamba_expand", 2)) * hidden // n_heads,
        n_groups=int(cfg.get("mamba_ngroups", 1)),
        d_state=int(cfg.get("mamba_d_state", 64)),
        d_conv=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("chunk_size", 256)),
        conv_bias=True,
        proj_bias=bool(cfg.get("add_bias_linear", False)),
        time_step_limit=(float(cfg.get("time_step_min", 0.001)), math.inf),
        norm_eps=1e-5,
    )
    mlp = MLPConfig(int(cfg.get("intermediate_size") or 4 * hidden), cfg.get("hidden_act", "gelu"),
                    bool(cfg.get("add_bias_linear", False)), fused_gate_up=True)  # fmt: skip
    tied = bool(cfg.get("tie_word_embeddings", True))
    shared = SharedBlocksConfig(int(cfg.get("num_mem_blocks", 1)), int(cfg.get("adapter_rank", 128)),
                                bool(cfg.get("use_shared_attention_adapter", False)), shared=tied)  # fmt: skip
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=tuple("dense" if k == "hybrid" else "none" for k in layer_types),  # the shared block's MLP
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=tied,
        ssm_chunk_size=m2.chunk_size,
        attention=attn if "hybrid" in layer_types else None,
        mlp=mlp,
        mamba2=m2,
        shared_blocks=shared if "hybrid" in layer_types else None,
    )


_ZAMBA_KINDS = {"mamba": "mamba1", "linear_attention": "mamba1", "hybrid": "hybrid_mamba1"}


def _zamba_default_kinds(cfg: Mapping[str, Any], n: int) -> list[str]:
    """transformers' ZambaConfig default: mamba, mamba, hybrid, then hybrid where i % period == offset."""
    period, offset = int(cfg.get("attn_layer_period", 6)), int(cfg.get("attn_layer_offset", 4))
    rest = ["hybrid" if i % period == offset else "mamba" for i in range(n - 3)]
    return (["mamba", "mamba", "hybrid"] + rest)[:n]


def _zamba(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Zamba (v1): multi-head Mamba1 layers, one shared block (no adapters, no RoPE) at the hybrid layers."""
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types") or _zamba_default_kinds(cfg, n)
    if len(kinds) != n or set(kinds) - set(_ZAMBA_KINDS):
        raise ValueError(f"{arch}: layers_block_type must list {n} of {sorted(_ZAMBA_KINDS)}, got {kinds}")
    layer_types = tuple(_ZAMBA_KINDS[k] for k in kinds)
    rank = cfg.get("mamba_dt_rank", "auto")
    m1 = MultiHeadMamba1Config(
        d_inner=int(cfg.get("mamba_expand", 2)) * hidden,
        d_state=int(cfg.get("mamba_d_state", 16)),
        d_conv=int(cfg.get("mamba_d_conv", 4)),
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        activation=cfg.get("hidden_mamba_act", "silu"),
        num_heads=int(cfg.get("n_mamba_heads", 2)),
    )
    mlp = MLPConfig(int(cfg.get("intermediate_size") or 4 * hidden), cfg.get("hidden_act", "gelu"))
    tied = bool(cfg.get("tie_word_embeddings", True))
    hybrid = "hybrid_mamba1" in layer_types
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=tuple("dense" if k == "hybrid_mamba1" else "none" for k in layer_types),  # the block's MLP
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=tied,
        ssm_chunk_size=DEFAULT_MAMBA1_CHUNK,
        attention=_shared_attention(cfg, hidden, None) if hybrid else None,
        mlp=mlp,
        mamba1=m1,
        shared_blocks=SharedBlocksConfig(1, 0, False, shared=tied) if hybrid else None,
    )
