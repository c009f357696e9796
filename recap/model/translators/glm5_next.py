"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, text model `Glm5NextTextConfig`, nested under
`text_config`): KDA layers and MLA layers whose queries attend what a DSA-style indexer selects (no positional
encoding), hyper-connections around every block, a dense MLP or an MoE with a shared expert (SwiGLU clamp).
The vision tower's weights are skipped (models/glm5_next.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import IndexedMLAConfig, KDAConfig
from recap.model.model_config import HyperConnectionConfig, ModelConfig
from recap.model.translators.common import LINEAR_CHUNK, UnsupportedArchitectureError, _common, nested_text_config

_KINDS = {"linear_attention": "kda", "indexed_attention": "indexed_attention", "full_attention": "indexed_attention"}
_MLPS = {"dense": "dense", "sparse": "moe"}


def _indexer_types(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Per layer "full" or "shared", as transformers' config derives it when config.json has no list."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _layers(cfg: Mapping[str, Any], arch: str, n: int) -> tuple[list[str], list[str]]:
    types = cfg.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    mlps = cfg.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    unknown = sorted({*types} - {*_KINDS} | {*mlps} - {*_MLPS})
    if unknown or len(types) != n or len(mlps) != n:
        raise UnsupportedArchitectureError(f"{arch}: layer types {unknown or 'of the wrong length'}")
    return [_KINDS[t] for t in types], [_MLPS[m] for m in mlps]


def _indexed_mla(cfg: Mapping[str, Any], arch: str, eps: float) -> IndexedMLAConfig:
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads or int(cfg.get("qk_rope_head_dim") or 0):
        raise UnsupportedArchitectureError(f"{arch}: DSA layers need num_key_value_heads = heads and no RoPE dims")
    if cfg.get("q_lora_rank") is None:
        raise UnsupportedArchitectureError(f"{arch}: DSA layers need q_lora_rank")
    return IndexedMLAConfig(
        num_heads=heads, kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), q_lora_rank=int(cfg["q_lora_rank"]),
        index_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg["index_topk"]), index_kpool=int(cfg.get("index_kpool", 16)),
        index_tail=bool(cfg.get("index_kpool_always_select_tail", True)),
        bias=bool(cfg.get("attention_bias", False)), norm_eps=eps,
    )  # fmt: skip


def _feed_forward(cfg: Mapping[str, Any]) -> tuple[MLPConfig, MoEConfig]:
    act, limit = cfg.get("hidden_act", "silu"), cfg.get("swiglu_limit")
    limit = None if limit is None else float(limit)
    moe_size = int(cfg["moe_intermediate_size"])
    moe = MoEConfig(
        num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]), intermediate_size=moe_size,
        activation=act, scoring="sigmoid", renormalize=bool(cfg.get("norm_topk_prob", True)), correction_bias=True,
        num_groups=int(cfg.get("n_group", 1)), topk_groups=int(cfg.get("topk_group", 1)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=moe_size * int(cfg.get("n_shared_experts", 1)), swiglu_limit=limit,
    )  # fmt: skip
    return MLPConfig(int(cfg["intermediate_size"]), act, swiglu_limit=limit), moe


def _glm5_text(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    kinds, mlps = _layers(cfg, arch, n)
    indexers = _indexer_types(cfg, n)
    shared = tuple(i for i, k in enumerate(kinds) if k == "indexed_attention" and indexers[i] == "shared")
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    mlp, moe = _feed_forward(cfg)
    bound = cfg.get("linear_lower_bound", -5.0)
    return ModelConfig(
        **_common(cfg, arch),
        layer_types=tuple(kinds),
        mlp_types=tuple(mlps),
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ssm_chunk_size=LINEAR_CHUNK,
        mlp=mlp,
        moe=moe if "moe" in mlps else None,
        indexed_mla=_indexed_mla(cfg, arch, eps) if "indexed_attention" in kinds else None,
        shared_index_layers=shared,
        kda=KDAConfig(
            num_heads=int(cfg["linear_num_heads"]), head_dim=int(cfg["linear_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), norm_eps=eps, layout="glm5",
            gate_lower_bound=None if bound is None else float(bound),
        ),  # fmt: skip
        hyper_connections=HyperConnectionConfig(
            int(cfg.get("hc_mult", 4)), int(cfg.get("hc_sinkhorn_iters", 20)), float(cfg.get("hc_eps", 1e-6))
        ),
    )


def _glm5_next(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    """The hub's checkpoints: the text model's config nested under `text_config`."""
    text = nested_text_config(cfg, arch)
    return dataclasses.replace(_glm5_text(text, arch), architecture=arch)
