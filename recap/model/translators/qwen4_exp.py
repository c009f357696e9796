"""Qwen4-Exp (`Qwen4ExpForCausalLM`, model_type "qwen4_exp_text"): Qwen3.5's Gated DeltaNet layers, attention
layers whose queries attend the tokens a block indexer selects (QSA; "indexed_attention" / "full_attention"),
hyper-connections (`hc_count` streams) around every mixer and MoE (every layer: softmax top-k, a gated shared
expert). Refused with the reason: per-layer n-gram embeddings (`ple_layer_ids`), a sigmoid GDN output gate,
attention layers without the indexer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MoEConfig
from recap.model.mixer_configs import QSAAttentionConfig
from recap.model.model_config import GatedResidualConfig, ModelConfig
from recap.model.translators.common import GDN_CHUNK, UnsupportedArchitectureError, _attention, _common, _rope
from recap.model.translators.gated_deltanet import _gdn_config

_KINDS = {"linear_attention": "gdn", "indexed_attention": "attention", "full_attention": "attention"}
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def _qwen4_layers(cfg: Mapping[str, Any], arch: str) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval", 4))
    names = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)
    ]
    if len(names) != n or any(t not in _KINDS for t in names):
        raise UnsupportedArchitectureError(f"{arch}: layer_types {names} (need {n} of {sorted(_KINDS)})")
    return tuple(_KINDS[t] for t in names)


def _refuse_unsupported(cfg: Mapping[str, Any], arch: str, kinds: tuple[str, ...]) -> None:
    if cfg.get("ple_layer_ids"):
        raise UnsupportedArchitectureError(f"{arch}: per-layer n-gram embeddings (ple_layer_ids) are not supported")
    if (cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")) != "silu":
        raise UnsupportedArchitectureError(f"{arch}: a GDN output gate other than silu is not supported")
    if "attention" in kinds and any(cfg.get(k) is None for k in _QSA):
        raise UnsupportedArchitectureError(f"{arch}: attention layers without the QSA indexer are not supported")
    if "attention" in kinds and int(cfg["indexer_kv_heads"]) != 1:
        raise UnsupportedArchitectureError(f"{arch}: QSA needs indexer_kv_heads = 1")


def _qsa(cfg: Mapping[str, Any], arch: str, eps: float) -> QSAAttentionConfig:
    theta, partial = _rope(cfg, arch, 0.25)
    base = _attention(cfg, theta, partial)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return QSAAttentionConfig(
        **{**fields, "qk_norm": "head", "output_gate": True, "qk_norm_eps": eps},
        index_heads=int(cfg["indexer_n_heads"]), index_head_dim=int(cfg["indexer_head_dim"]),
        index_budget=int(cfg["indexer_budget"]), index_ratio=int(cfg["indexer_compress_ratio"]),
    )  # fmt: skip


def _qwen4_exp(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    kinds = _qwen4_layers(cfg, arch)
    _refuse_unsupported(cfg, arch, kinds)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    moe = MoEConfig(  # Qwen3-Next's: softmax, top-k, renormalized if norm_topk_prob, a gated shared expert
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), activation=cfg.get("hidden_act", "silu"),
        renormalize=bool(cfg.get("norm_topk_prob", True)), expert_layout="list",
        shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]), shared_gate=True,
    )  # fmt: skip
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=kinds,
        mlp_types=("moe",) * len(kinds),
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=GDN_CHUNK,
        attention=_qsa(cfg, arch, eps) if "attention" in kinds else None,
        moe=moe,
        gdn=_gdn_config(cfg, "qwen3_5", eps),
        gated_residual=GatedResidualConfig(int(cfg.get("hc_count", 4)), int(cfg.get("hc_lowrank", 320))),
    )
