"""Ling 3.0 (`BailingHybridForCausalLM`; the hub's `BailingMoeV3ForCausalLM` / `BailingMoeV2_5ForCausalLM`,
model_type "bailing_hybrid"): KDA layers and, last in every `layer_group_size` group, MLA with RoPE and a
per-head output gate; dense MLPs in the first `first_k_dense_replace` layers, then an MoE with a shared expert
(sigmoid router, grouped top-k, correction bias). config.json may spell the MoE fields either way
transformers' attribute map does (num_experts / num_local_experts, num_experts_per_token / _tok, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.mixer_configs import KDAConfig, MLAConfig
from recap.model.model_config import ModelConfig
from recap.model.translators.common import LINEAR_CHUNK, UnsupportedArchitectureError, _common, _pick, _rope

_MIXERS = {"linear_attention": "kda", "full_attention": "attention"}
_MLPS = {"dense": "dense", "sparse": "moe"}


def _bailing_layers(cfg: Mapping[str, Any], arch: str, n: int) -> tuple[list[str], list[str]]:
    """(mixer kinds, mlp kinds) from layer_types / mlp_layer_types, else as transformers derives them."""
    group = int(cfg.get("layer_group_size", 6))
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)
    ]
    dense = int(cfg.get("first_k_dense_replace", 2))
    mlps = cfg.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)]
    unknown = sorted({*kinds} - {*_MIXERS} | {*mlps} - {*_MLPS})
    if unknown or len(kinds) != n or len(mlps) != n:
        raise UnsupportedArchitectureError(f"{arch}: layer types {unknown or 'of the wrong length'}")
    return [_MIXERS[k] for k in kinds], [_MLPS[m] for m in mlps]


def _bailing_moe(cfg: Mapping[str, Any]) -> MoEConfig:
    size = int(cfg["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(_pick(cfg, 512, "num_experts", "num_local_experts")),
        top_k=int(_pick(cfg, 8, "num_experts_per_token", "num_experts_per_tok")),
        intermediate_size=size, activation=cfg.get("hidden_act", "silu"), scoring="sigmoid",
        renormalize=bool(_pick(cfg, True, "moe_renormalize", "norm_topk_prob")), correction_bias=True,
        num_groups=int(_pick(cfg, 8, "num_expert_group", "n_group")), topk_groups=int(cfg.get("topk_group", 4)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        shared_intermediate_size=size * int(_pick(cfg, 1, "num_shared_experts", "n_shared_experts")),
    )  # fmt: skip


def _bailing_mla(cfg: Mapping[str, Any], arch: str, eps: float) -> MLAConfig:
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedArchitectureError(f"{arch}: MLA with num_key_value_heads != num_attention_heads")
    theta, _ = _rope(cfg, arch)  # transformers rotates all qk_rope_head_dim dims (no partial factor)
    return MLAConfig(
        num_heads=heads, kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        bias=bool(cfg.get("attention_bias", False)), rope_theta=theta, head_gate=True,
    )  # fmt: skip


def _bailing_hybrid(cfg: Mapping[str, Any], arch: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    kinds, mlps = _bailing_layers(cfg, arch, n)
    if cfg.get("hidden_act", "silu") != "silu":  # transformers' KDA convs apply it too; recap's are silu
        raise UnsupportedArchitectureError(f"{arch}: hidden_act {cfg['hidden_act']!r} (KDA convs need silu)")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    bound = float(cfg.get("kda_lower_bound", -5.0)) if cfg.get("kda_safe_gate", True) else None
    # the DeepSeek-V3-style MTP module (models/nextn.py): the last layer's attention with a MoE (transformers'
    # get_mtp_config drops first_k_dense_replace for it), a dense MLP where the model has no MoE
    nextn = int(_pick(cfg, 0, "num_nextn_predict_layers", "num_mtp_layers")) > 0
    mtp_mlp = "moe" if cfg.get("moe_intermediate_size") else "dense"
    return ModelConfig(
        **{**_common(cfg, arch), "max_position_embeddings": _pick(cfg, None, "max_position_embeddings",
                                                                   "model_max_length")},
        layer_types=tuple(kinds),
        mlp_types=tuple(mlps),
        norm_eps=eps,
        tie_word_embeddings=False,  # transformers' class ties nothing (_tied_weights_keys = {}), whatever it says
        ssm_chunk_size=LINEAR_CHUNK,
        mlp=MLPConfig(int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu")),
        moe=_bailing_moe(cfg) if "moe" in mlps or (nextn and mtp_mlp == "moe") else None,
        mla=_bailing_mla(cfg, arch, eps) if "attention" in kinds or nextn else None,
        mtp_layer_types=("attention",) if nextn else (),
        mtp_mlp_types=(mtp_mlp,) if nextn else (),
        kda=KDAConfig(
            num_heads=int(_pick(cfg, cfg["num_attention_heads"], "linear_num_heads")),
            head_dim=int(_pick(cfg, 128, "linear_head_dim", "head_dim")),
            conv_kernel=int(_pick(cfg, 4, "linear_conv_kernel_dim", "short_conv_kernel_size")), norm_eps=eps,
            layout="bailing", gate_lower_bound=bound,
        ),  # fmt: skip
    )
