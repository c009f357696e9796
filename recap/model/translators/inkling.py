"""Inkling (InklingForCausalLM, and InklingForConditionalGeneration loaded text-only): conv_attention layers
(full or sliding attention with short convs and a relative bias), dense or sink-MoE feed-forwards.

config.json as the hub writes it: `layer_types` may be missing (then `local_layer_ids`, else every layer but
each sixth is sliding), `mlp_layer_types` too (then `dense_mlp_idx` leading dense layers), and
`dense_intermediate_size`, where present, is the dense width (`intermediate_size` the experts' then), as
InklingTextConfig reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.inkling_configs import Inkling2AttentionConfig, OutputConvsConfig, RelBiasAttentionConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import (
    LINEAR_CHUNK,
    UnsupportedArchitectureError,
    _common,
    _pick,
    nested_text_config,
)

_KINDS = ("hybrid", "hybrid_sliding")


def _layer_types(cfg: Mapping[str, Any], arch: str, n: int) -> tuple[list[str], list[str]]:
    kinds = cfg.get("layer_types")
    if kinds is None:
        local = cfg.get("local_layer_ids")
        ids = set(local) if local is not None else {i for i in range(n) if (i + 1) % 6}
        kinds = ["hybrid_sliding" if i in ids else "hybrid" for i in range(n)]
    mlps = cfg.get("mlp_layer_types")
    if mlps is None:
        dense = int(cfg.get("dense_mlp_idx", 0))
        mlps = ["dense" if i < dense else "sparse" for i in range(n)]
    if len(kinds) != n or set(kinds) - set(_KINDS) or len(mlps) != n or set(mlps) - {"dense", "sparse"}:
        raise UnsupportedArchitectureError(f"{arch}: layer_types {kinds} / mlp_layer_types {mlps}")
    return list(kinds), list(mlps)


def _attention(cfg: Mapping[str, Any], sliding: bool, kernel: int, window: int) -> RelBiasAttentionConfig:
    p = "swa_" if sliding else ""
    head_dim = int(cfg.get(f"{p}head_dim", 128))
    floor = None if sliding else cfg.get("log_scaling_n_floor")
    return RelBiasAttentionConfig(
        num_heads=int(cfg.get(f"{p}num_attention_heads", 64)),
        num_kv_heads=int(cfg.get(f"{p}num_key_value_heads", 16 if sliding else 8)),
        head_dim=head_dim, rope_theta=None, rotary_dim=0, scale=1.0 / head_dim,  # q/k are RMS-normed: 1 / d
        qk_norm="head", qk_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), kv_conv_kernel=kernel,
        d_rel=int(cfg.get("d_rel", 16)), rel_extent=window if sliding else int(cfg.get("rel_extent", 1024)),
        log_scaling_floor=int(floor) if floor is not None else None,
        log_scaling_alpha=float(cfg.get("log_scaling_alpha", 0.1)),
    )  # fmt: skip


def _feed_forwards(cfg: Mapping[str, Any], arch: str) -> tuple[MLPConfig, MoEConfig]:
    act = str(cfg.get("hidden_act", "silu"))
    dense, experts = int(cfg.get("intermediate_size", 24576)), int(cfg.get("moe_intermediate_size", 3072))
    if cfg.get("dense_intermediate_size") is not None:
        dense, experts = int(cfg["dense_intermediate_size"]), dense
    shared = int(cfg.get("n_shared_experts", 2))
    if shared < 1:
        # transformers' router slices its logits at -n_shared_experts: with none it routes over no expert
        raise UnsupportedArchitectureError(f"{arch}: n_shared_experts must be >= 1 (transformers needs one)")
    moe = MoEConfig(
        num_experts=int(_pick(cfg, 256, "n_routed_experts", "num_local_experts")),
        top_k=int(cfg.get("num_experts_per_tok", 6)), intermediate_size=experts, activation=act,
        scoring="sigmoid", correction_bias=True, routed_scaling_factor=float(cfg.get("route_scale", 8.0)),
        expert_layout="stacked", shared_sink=shared,
    )  # fmt: skip
    return MLPConfig(dense, activation=act), moe


def _inkling(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    kinds, mlps = _layer_types(cfg, arch, n)
    kernel = int(_pick(cfg, 4, "conv_kernel_size", "sconv_kernel_size"))
    window = int(_pick(cfg, 512, "sliding_window_size", "sliding_window"))
    swa = _attention(cfg, True, kernel, window)
    mlp, moe = _feed_forwards(cfg, arch)
    common = _common(cfg, arch)
    # MTP modules (transformers' mtp_layer_types): conv-attention layers with a dense MLP. Declared so that asking
    # for them names why recap cannot draft with them (their output convs keep state: model/mtp_load.py).
    mtp = ("conv_attention",) if int(cfg.get("num_mtp_layers") or 0) > 0 else ()
    vocab, unpadded = common["vocab_size"], cfg.get("unpadded_vocab_size")
    if unpadded is not None and int(unpadded) < vocab:
        common["vocab_size"] = int(unpadded)
    return ModelConfig(
        **common,
        padded_vocab_size=vocab if common["vocab_size"] < vocab else None,
        layer_types=("conv_attention",) * n,
        mlp_types=tuple("moe" if m == "sparse" else "dense" for m in mlps),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=False,  # separate `embed` and `unembed` tensors: transformers never ties them
        ssm_chunk_size=LINEAR_CHUNK,
        logits_multiplier=1.0 / float(_pick(cfg, 24.0, "logits_mup_width_multiplier", "embedding_multiplier")),
        attention=_attention(cfg, False, kernel, window),
        layer_attention=tuple(swa if k == "hybrid_sliding" else None for k in kinds),
        attention_windows=tuple(window if k == "hybrid_sliding" else 0 for k in kinds),
        mlp=mlp if "dense" in mlps or mtp else None,
        moe=moe if "sparse" in mlps else None,
        output_convs=OutputConvsConfig(int(cfg["hidden_size"]), kernel),
        mtp_layer_types=mtp,
        mtp_mlp_types=("dense",) * len(mtp),
    )


def _inkling_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """InklingForConditionalGeneration (the hub's checkpoints): the text model of its `text_config`, loaded
    text-only, its weights in Thinking Machines' layout: fused gate/up projections with alternating rows."""
    text = _inkling(nested_text_config(cfg, arch), arch)
    mlp = None if text.mlp is None else dataclasses.replace(text.mlp, fused_gate_up=True, interleaved_gate_up=True)
    moe = None if text.moe is None else dataclasses.replace(text.moe, interleaved_gate_up=True)
    return dataclasses.replace(text, architecture=arch, mlp=mlp, moe=moe)


def _inkling2_attention(cfg: Mapping[str, Any], sliding: bool, kernel: int, window: int) -> Inkling2AttentionConfig:
    """RelBiasAttentionConfig's fields as Inkling's, but scale head_dim^-0.5, log scaling on every full layer."""
    base = {f.name: getattr(_attention(cfg, sliding, kernel, window), f.name)
            for f in dataclasses.fields(RelBiasAttentionConfig)}  # fmt: skip
    floor = None if sliding else cfg.get("log_scaling_n_floor", 128000)
    return Inkling2AttentionConfig(
        **{**base, "scale": None, "qk_norm": "none", "log_scaling_floor": int(floor) if floor is not None else None},
        qk_clip=float(cfg.get("qk_l2_clip_threshold", 22.627416997969522)),
        rel_clip=float(cfg.get("rel_l2_clip_threshold", 8.0)), dynamic_kv=not sliding,
    )  # fmt: skip


def _inkling2(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Inkling-2's text model: every sixth layer full (dynamic K/V convs), the others sliding; MoE everywhere."""
    n = int(cfg["num_hidden_layers"])
    kinds = list(cfg.get("layer_types") or ["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(n)])
    if len(kinds) != n or set(kinds) - set(_KINDS):
        raise UnsupportedArchitectureError(f"{arch}: layer_types {kinds}")
    kernel = int(_pick(cfg, 4, "conv_kernel_size", "sconv_kernel_size"))
    window = int(_pick(cfg, 1024, "sliding_window_size", "sliding_window"))
    swa = _inkling2_attention(cfg, True, kernel, window)
    scoring = str(cfg.get("scoring_func", "sigmoid"))
    moe = MoEConfig(
        num_experts=int(_pick(cfg, 384, "n_routed_experts", "num_local_experts")),
        top_k=int(cfg.get("num_experts_per_tok", 8)),
        intermediate_size=int(_pick(cfg, 2304, "moe_intermediate_size", "intermediate_size")),
        scoring=scoring, correction_bias=True, renormalize=True,
        routed_scaling_factor=float(_pick(cfg, 8.0, "route_scale", "routed_scaling_factor")),
        expert_layout="stacked", interleaved_gate_up=True,
        softcaps=(float(cfg.get("mlp_gate_softcap", 4.0)), float(cfg.get("mlp_up_softcap", 25.0))),
    )  # fmt: skip
    common = _common(cfg, arch)
    vocab, unpadded = common["vocab_size"], int(cfg.get("unpadded_vocab_size", 200058))
    common["vocab_size"] = min(vocab, unpadded)
    cap = cfg.get("final_logit_softcapping", 30.0)
    return ModelConfig(
        **common,
        padded_vocab_size=vocab if unpadded < vocab else None,
        layer_types=("conv_attention",) * n,
        mlp_types=("moe",) * n,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=False,  # `embed` and `unembed` are separate tensors
        ssm_chunk_size=LINEAR_CHUNK,
        logits_soft_cap=float(cap) if cap is not None else None,
        attention=_inkling2_attention(cfg, False, kernel, window),
        layer_attention=tuple(swa if k == "hybrid_sliding" else None for k in kinds),
        attention_windows=tuple(window if k == "hybrid_sliding" else 0 for k in kinds),
        moe=moe,
        output_convs=OutputConvsConfig(int(cfg["hidden_size"]), kernel, scaled=True),
        attention_residual_block=int(cfg.get("n_layers_per_attn_res_block", 6)),
    )


def _inkling2_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """Inkling2ForConditionalGeneration: the text model of its `text_config`, loaded text-only."""
    return dataclasses.replace(_inkling2(nested_text_config(cfg, arch), arch), architecture=arch)
