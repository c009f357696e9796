"""Qwen4-Exp (`Qwen4ExpForCausalLM`, model_type "qwen4_exp_text"): Qwen3.5's Gated DeltaNet layers, attention
layers whose queries attend the tokens a block indexer selects (QSA; "indexed_attention" / "full_attention"),
hyper-connections (`hc_count` streams) around every mixer and MoE (every layer: softmax top-k, a gated shared
expert); the GDN layers named by `ple_layer_ids` (1-indexed) add per-layer n-gram embeddings ("gdn_ple").
Refused with the reason: a sigmoid GDN output gate, attention layers without the indexer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MoEConfig
from recap.model.model_config import GatedResidualConfig, ModelConfig
from recap.model.qwen4_configs import PerLayerEmbeddingConfig, PLEGatedDeltaNetConfig, QSAAttentionConfig
from recap.model.translators.common import (
    GDN_CHUNK,
    UnsupportedArchitectureError,
    _attention,
    _common,
    _rope,
    nested_text_config,
)
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


def _ple(cfg: Mapping[str, Any], arch: str, kinds: tuple[str, ...]) -> PerLayerEmbeddingConfig | None:
    """The PLE layers' settings (ple_layer_ids are 1-indexed GDN layers), None without any."""
    layers = tuple(sorted({int(i) - 1 for i in cfg.get("ple_layer_ids") or ()}))
    if not layers:
        return None
    if any(not 0 <= i < len(kinds) or kinds[i] != "gdn" for i in layers):
        raise UnsupportedArchitectureError(f"{arch}: ple_layer_ids must name linear_attention layers")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        raise UnsupportedArchitectureError(f"{arch}: PLE layers need eos_token_id")
    return PerLayerEmbeddingConfig(
        layers=layers, streams=int(cfg.get("hc_count", 4)),
        embed_dim=int(cfg.get("ple_embed_dim") or cfg["hidden_size"]),
        conv_kernel=int(cfg.get("ple_conv_kernel_size", 4)), ngram_size=int(cfg.get("ngram_size", 3)),
        heads_per_ngram=int(cfg.get("heads_per_ngram", 8)), vocab_size=int(cfg["vocab_size"]),
        vocab_base=int(cfg.get("ngram_vocab_size_base", 20_000_000)),
        vocab_multiple=int(cfg.get("make_ngram_vocab_size_divisible_by", 128)), seed=int(cfg.get("seed", 1234)),
        shards=int(cfg.get("split_ngram_parts", 512)), eos_token_id=int(eos),
    )  # fmt: skip


def _refuse_unsupported(cfg: Mapping[str, Any], arch: str, kinds: tuple[str, ...]) -> None:
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
    gdn, ple = _gdn_config(cfg, "qwen3_5", eps), _ple(cfg, arch, kinds)
    if ple is not None:
        kinds = tuple("gdn_ple" if i in ple.layers else k for i, k in enumerate(kinds))
    fields = {f.name: getattr(gdn, f.name) for f in dataclasses.fields(gdn)}
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
        gdn=gdn if "gdn" in kinds else None,
        gdn_ple=None if ple is None else PLEGatedDeltaNetConfig(**fields, ple=ple, hidden_size=int(cfg["hidden_size"])),
        gated_residual=GatedResidualConfig(int(cfg.get("hc_count", 4)), int(cfg.get("hc_lowrank", 320))),
    )


def _qwen4_exp_vl(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """The hub's vision-language checkpoint (`Qwen4ExpForConditionalGeneration`): the text config nested under
    `text_config`, loaded text-only."""
    return dataclasses.replace(_qwen4_exp(nested_text_config(cfg, arch), arch), architecture=arch)
