"""Short-conv and KDA hybrids: LFM2, LFM2-MoE, LFM3 (sliding-window attention), Kimi-Linear (KDA + MLA)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import AttentionConfig, KDAConfig, MLAConfig, ShortConvConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import (
    LINEAR_CHUNK,
    UnsupportedArchitectureError,
    _common,
    nested_text_config,
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


_LFM_VL_TEXT = {"Lfm2VlForConditionalGeneration": "Lfm2ForCausalLM",
                "Lfm3VlForConditionalGeneration": "Lfm3ForCausalLM"}  # fmt: skip


def _lfm_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """LFM2-VL / LFM3-VL: the text model of `text_config`, loaded text-only (the vision tower is skipped)."""
    return dataclasses.replace(_lfm(nested_text_config(cfg, arch), _LFM_VL_TEXT[arch]), architecture=arch)
