"""Translators: one function per HF architecture, from its config.json dict to a `ModelConfig`.

Registered in `TRANSLATORS`; adding a family = one translator here + one model file in `models/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from recap.model.config import (
    DEFAULT_MAMBA1_CHUNK,
    AttentionConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    Mamba1Config,
    Mamba2Config,
    MLAConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    SharedBlocksConfig,
    ShortConvConfig,
    UnsupportedArchitectureError,
)

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


def _pick(cfg: Mapping[str, Any], default: Any, *names: str) -> Any:
    """The first of `names` present in cfg (current name first, then legacy ones), else `default`."""
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


# Nemotron-H layer kinds: hybrid_override_pattern characters and layers_block_type names (current and legacy).
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
        attention=attn if "attention" in layer_types else None,
        mlp=MLPConfig(int(cfg.get("intermediate_size", 21504)), act, bool(cfg.get("mlp_bias", False)), gated=False),
        moe=moe if "moe" in mlp_types else None,
        mamba2=m2 if "mamba2" in layer_types else None,
    )


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


# Gated DeltaNet hybrids: the chunk grid the runner cuts GDN rows on (fla's and transformers' chunk size).
GDN_CHUNK = 64


def _gdn_layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    names = cfg.get("layer_types")
    if names is None:  # older Qwen3-Next configs: every full_attention_interval-th layer is attention
        interval = int(cfg.get("full_attention_interval", 4))
        names = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    kinds = {"full_attention": "attention", "linear_attention": "gdn"}
    if len(names) != n or any(t not in kinds for t in names):
        raise ValueError(f"layer_types must name {n} layers, each full_attention or linear_attention: {names}")
    return tuple(kinds[t] for t in names)


def _gdn_config(
    cfg: Mapping[str, Any], projection: str, norm_eps: float, beta_scale: float = 1.0
) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(
        num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]),
        head_k_dim=int(cfg["linear_key_head_dim"]),
        head_v_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        norm_eps=norm_eps,
        projection=projection,
        activation=cfg.get("hidden_act", "silu"),
        beta_scale=beta_scale,
    )


def _qwen_gdn(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Qwen3.5 / 3.6 (dense, MoE) and Qwen3-Next: GDN + gated attention (per-head q/k norm, output gate)."""
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    layer_types = _gdn_layer_types(cfg)
    n = len(layer_types)
    theta, partial = _rope(cfg, arch, 0.25)
    attn = dataclasses.replace(_attention(cfg, theta, partial), qk_norm="head", output_gate=True)
    moe = None
    mlp_types = ("dense",) * n
    if arch.startswith("Qwen3_5Moe") or (arch == "Qwen3NextForCausalLM" and int(cfg.get("num_experts", 0)) > 0):
        step, dense_only = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        mlp_types = tuple("dense" if i in dense_only or (i + 1) % step else "moe" for i in range(n))
        moe = MoEConfig(  # softmax, top-k, renormalized (Qwen3-Next: if norm_topk_prob), gated shared expert
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            activation=cfg.get("hidden_act", "silu"),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            expert_layout="list",  # on disk per expert (transformers fuses them only in memory)
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
            shared_gate=bool(cfg.get("shared_expert_intermediate_size", 0)),
        )
    dense = MLPConfig(int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu")) if "dense" in mlp_types else None
    projection = "qwen3_next" if arch == "Qwen3NextForCausalLM" else "qwen3_5"
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=mlp_types,
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=GDN_CHUNK,
        attention=attn,
        mlp=dense,
        moe=moe,
        gdn=_gdn_config(cfg, projection, eps),
    )


def _qwen3_5_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """The hub's Qwen3.5 / 3.6 checkpoints: the text model's config nested under `text_config`."""
    if not isinstance(cfg.get("text_config"), Mapping):
        raise ValueError(f"{arch}: config.json has no text_config")
    text = dict(cfg["text_config"])
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:  # the outer config governs the head tying and the generation ids
            text[key] = cfg[key]
    causal = arch.replace("ForConditionalGeneration", "ForCausalLM")
    return dataclasses.replace(_qwen_gdn(text, causal), architecture=arch)


def _olmo_hybrid(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """OLMo-Hybrid: GDN (separate projections, beta up to 2) + OLMo-3 attention (q/k norm over all heads)."""
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    layer_types = _gdn_layer_types(cfg)
    theta, partial = _rope(cfg, arch, 1.0)
    beta_scale = 2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=layer_types,
        mlp_types=("dense",) * len(layer_types),
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=GDN_CHUNK,
        attention=dataclasses.replace(_attention(cfg, theta, partial), qk_norm="all"),
        mlp=MLPConfig(int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu")),
        gdn=_gdn_config(cfg, "olmo_hybrid", 1e-5, beta_scale),  # transformers fixes the output norm's eps
    )


_ZAMBA2_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "hybrid": "hybrid"}


def _zamba2(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not kinds or len(kinds) != n or set(kinds) - set(_ZAMBA2_KINDS):
        raise ValueError(f"{arch}: layers_block_type must list {n} of {sorted(_ZAMBA2_KINDS)}, got {kinds}")
    layer_types = tuple(_ZAMBA2_KINDS[k] for k in kinds)
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = 2 * hidden // heads  # the shared block attends over [h | embeddings], 2 * hidden wide
    theta = _rope(cfg, arch)[0] if cfg.get("use_mem_rope") else None
    attn = AttentionConfig(
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=head_dim if theta is not None else 0,
        scale=(head_dim / 2) ** -0.5,  # transformers' Zamba2 scales by sqrt(head_dim / 2)
        input_size=2 * hidden,
    )
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


def _lfm_rope(arch: str, rope: Mapping[str, Any], head_dim: int) -> tuple[float, int | None]:
    """(theta, rope_angles) of an LFM RoPE entry: "default" turns every pair, "proportional" the first share."""
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UnsupportedArchitectureError(f"{arch}: rope_type {kind!r} is not supported")
    if float(rope.get("factor", 1.0)) != 1.0:
        raise UnsupportedArchitectureError(f"{arch}: a RoPE factor other than 1 is not supported")
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2) if kind == "proportional" else None
    return float(rope.get("rope_theta", 1_000_000.0)), angles


def _lfm_attention(cfg: Mapping[str, Any], arch: str, rope: Mapping[str, Any], gate: bool) -> AttentionConfig:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    theta, angles = _lfm_rope(arch, rope, head_dim)
    return AttentionConfig(
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=theta, rotary_dim=head_dim, bias=bool(cfg.get("attention_bias", False)), qk_norm="head",
        qk_norm_eps=float(cfg.get("norm_eps", 1e-5)), head_gate=gate, rope_angles=angles,
    )  # fmt: skip


def _lfm_ff_dim(cfg: Mapping[str, Any]) -> int:
    """LFM2's feed-forward width: 2/3 of intermediate_size, times a multiplier, rounded up to a multiple."""
    size = int(cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            size = int(float(cfg["block_ffn_dim_multiplier"]) * size)
            multiple = int(cfg.get("block_multiple_of", 256))
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def _lfm(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM: gated short convs + (sliding-window) attention."""
    kinds = list(cfg.get("layer_types") or [])
    n = int(cfg["num_hidden_layers"])
    if not kinds and arch == "Lfm2ForCausalLM":
        full = set(cfg.get("full_attn_idxs") or range(n))
        kinds = ["full_attention" if i in full else "conv" for i in range(n)]
    mixers = {"conv": "short_conv", "full_attention": "attention", "sliding_attention": "attention"}
    if len(kinds) != n or any(k not in mixers for k in kinds):
        raise UnsupportedArchitectureError(f"{arch}: layer_types {kinds} (need {n} of {sorted(mixers)})")
    rope = dict(cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 1_000_000.0)})
    lfm3 = arch == "Lfm3ForCausalLM"
    gate = lfm3 and bool(cfg.get("use_attention_gate", True))
    attention = _lfm_attention(cfg, arch, rope.get("full_attention", rope) if lfm3 else rope, gate)
    window = int(cfg.get("sliding_window") or 0) if lfm3 else 0
    if "sliding_attention" in kinds and window <= 0:
        raise UnsupportedArchitectureError(f"{arch}: sliding_attention layers without a sliding_window")
    # Sliding-window layers have their own RoPE (same KV shape): their own `layer_attention` entries.
    window_attention = _lfm_attention(cfg, arch, rope["sliding_attention"], gate) if window else None
    moe, dense_layers = None, n
    if arch == "Lfm2MoeForCausalLM":
        dense_layers = int(cfg.get("num_dense_layers", 0))
        moe = MoEConfig(
            num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]), scoring="sigmoid",
            renormalize=bool(cfg.get("norm_topk_prob", True)), correction_bias=bool(cfg.get("use_expert_bias", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )  # fmt: skip
    ff = _lfm_ff_dim(cfg) if arch == "Lfm2ForCausalLM" else int(cfg["intermediate_size"])
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=tuple(mixers[k] for k in kinds),
        mlp_types=tuple("dense" if i < dense_layers else "moe" for i in range(n)),
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        ssm_chunk_size=LINEAR_CHUNK,
        attention=attention,
        layer_attention=tuple(window_attention if k == "sliding_attention" else None for k in kinds) if window else (),
        attention_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds) if window else (),
        mlp=MLPConfig(intermediate_size=ff),
        moe=moe,
        post_norms=lfm3 and bool(cfg.get("use_sandwich_norm", True)),
        short_conv=ShortConvConfig(
            int(cfg["hidden_size"]), int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False))
        ),
    )


def _kimi_layers(cfg: Mapping[str, Any], arch: str, n: int) -> tuple[list[str], list[str]]:
    """(mixer kinds, mlp kinds): from layer_types / mlp_layer_types, else the checkpoint's linear_attn_config
    (1-indexed full_attn_layers / kda_layers) and first_k_dense_replace."""
    lin = cfg.get("linear_attn_config") or {}
    kinds = list(cfg.get("layer_types") or [])
    if not kinds and "full_attn_layers" in lin:
        full = {int(i) - 1 for i in lin["full_attn_layers"]}
        kinds = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    mlps = list(cfg.get("mlp_layer_types") or [])
    if not mlps:
        dense = int(cfg.get("first_k_dense_replace", 1))
        mlps = ["dense" if i < dense else "sparse" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full_attention", "linear_attention"} or set(mlps) - {"dense", "sparse"}:
        raise UnsupportedArchitectureError(f"{arch}: layer_types {kinds} / mlp_layer_types {mlps}")
    mixers = ["attention" if k == "full_attention" else "kda" for k in kinds]
    return mixers, ["moe" if m == "sparse" else "dense" for m in mlps]


def _kimi_linear(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """KimiLinearForCausalLM: KDA layers + MLA layers (no positional encoding) + MoE with shared experts."""
    n = int(cfg["num_hidden_layers"])
    kinds, mlps = _kimi_layers(cfg, arch, n)
    lin = cfg.get("linear_attn_config") or {}
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedArchitectureError(f"{arch}: MLA with num_key_value_heads != num_attention_heads")
    get = lambda *names, default=None: next((cfg[k] for k in names if cfg.get(k) is not None), default)  # noqa: E731
    num_experts = int(get("num_experts", "num_local_experts", "n_routed_experts", default=0))
    shared = int(get("num_shared_experts", "n_shared_experts", default=0))
    moe_size = int(cfg.get("moe_intermediate_size", 0))
    moe = None
    if "moe" in mlps:
        moe = MoEConfig(
            num_experts=num_experts, top_k=int(get("num_experts_per_token", "num_experts_per_tok")),
            intermediate_size=moe_size, activation=cfg.get("hidden_act", "silu"), scoring="sigmoid",
            renormalize=bool(get("moe_renormalize", "norm_topk_prob", default=True)), correction_bias=True,
            num_groups=int(get("num_expert_group", "n_group", default=1)),
            topk_groups=int(get("topk_group", default=1)),
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
            shared_intermediate_size=moe_size * shared,
        )  # fmt: skip
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=tuple(kinds),
        mlp_types=tuple(mlps),
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=LINEAR_CHUNK,
        mlp=MLPConfig(intermediate_size=int(cfg["intermediate_size"]), activation=cfg.get("hidden_act", "silu")),
        moe=moe,
        mla=MLAConfig(
            num_heads=heads, kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg.get("v_head_dim") or cfg["qk_nope_head_dim"]),
            q_lora_rank=cfg.get("q_lora_rank"), bias=bool(cfg.get("attention_bias", False)),
        ),  # fmt: skip
        kda=KDAConfig(
            num_heads=int(lin.get("num_heads", cfg.get("linear_num_heads", heads))),
            head_dim=int(lin.get("head_dim", cfg.get("linear_head_dim", 128))),
            conv_kernel=int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))),
            norm_eps=eps,
        ),
    )


TRANSLATORS: dict[str, Callable[[Mapping[str, Any], str], ModelConfig]] = {
    "MambaForCausalLM": _mamba,
    "FalconMambaForCausalLM": _mamba,
    "Mamba2ForCausalLM": _mamba2,
    "BambaForCausalLM": _bamba,
    "JambaForCausalLM": _jamba,
    "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_moe_hybrid,
    "FalconH1ForCausalLM": _falcon_h1,
    "Qwen3_5ForCausalLM": _qwen_gdn,
    "Qwen3_5MoeForCausalLM": _qwen_gdn,
    "Qwen3NextForCausalLM": _qwen_gdn,
    "Qwen3_5ForConditionalGeneration": _qwen3_5_vl,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_vl,
    "OlmoHybridForCausalLM": _olmo_hybrid,
    "Zamba2ForCausalLM": _zamba2,
    "Lfm2ForCausalLM": _lfm,
    "Lfm2MoeForCausalLM": _lfm,
    "Lfm3ForCausalLM": _lfm,
    "KimiLinearForCausalLM": _kimi_linear,
}
# For configs that name no architecture.
MODEL_TYPES = {
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}


def architecture_of(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
    elif cfg.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[cfg["model_type"]]
    else:
        arch = f"model_type={cfg.get('model_type')!r}"
    if arch not in TRANSLATORS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch}; supported: {', '.join(sorted(TRANSLATORS))}"
        )
    return arch


def translate_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF config dict (as read from config.json) into a ModelConfig."""
    arch = architecture_of(cfg)
    return TRANSLATORS[arch](cfg, arch)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model folder (Python's json accepts the bare `Infinity` literal)."""
    p = Path(path)
    with open(p / "config.json" if p.is_dir() else p) as f:
        return json.load(f)


def load_config(path: str | Path) -> ModelConfig:
    return translate_config(read_hf_config(path))
