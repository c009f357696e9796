"""Gated DeltaNet hybrids: Qwen3.5 / 3.6 (dense, MoE, hub ConditionalGeneration layouts), Qwen3-Next, OLMo-Hybrid,
and the MiniCPM-V 4.6 / 4.7 / MiniCPM-OCR wrappers around a Qwen3.5 text model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import GatedDeltaNetConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import (
    GDN_CHUNK,
    UnsupportedArchitectureError,
    _attention,
    _common,
    _rope,
    nested_text_config,
)


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
        # the `mtp.*` head a checkpoint may ship: one full-attention layer with the last layer's feed-forward
        mtp_layer_types=("attention",),
        mtp_mlp_types=(mlp_types[-1],),
    )


def _qwen3_5_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """The hub's Qwen3.5 / 3.6 checkpoints: the text model's config nested under `text_config`."""
    text = nested_text_config(cfg, arch)
    causal = arch.replace("ForConditionalGeneration", "ForCausalLM")
    return dataclasses.replace(_qwen_gdn(text, causal), architecture=arch)


def _minicpm_v(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR: the Qwen3.5 text model of `text_config` (transformers builds whatever
    its model_type names: only Qwen3.5's is this layout). MiniCPM-V 4.7's canvas M-RoPE moves image tokens only;
    text positions are Qwen3.5's. The outer tie flag governs the head (save_pretrained writes it; a config without
    one has its class's default: tied for MiniCPM-OCR only)."""
    if cfg.get("tie_word_embeddings") is None:
        cfg = {**cfg, "tie_word_embeddings": arch == "MiniCPMOcrForConditionalGeneration"}
    text = nested_text_config(cfg, arch)
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise UnsupportedArchitectureError(f"{arch}: text model {text['model_type']!r} is not supported "
                                           "(only qwen3_5_text)")  # fmt: skip
    return dataclasses.replace(_qwen_gdn(text, "Qwen3_5ForCausalLM"), architecture=arch)


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
