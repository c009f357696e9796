"""Ling 3.0 (`BailingHybridForCausalLM`; the hub's `BailingMoeV3ForCausalLM` / `BailingMoeV2_5ForCausalLM` are
aliases of it in the family registry):
KDA layers (full-rank f_proj / g_proj) with an MLA layer (RoPE, per-head output gate) closing each group, a dense
MLP or an MoE with a shared expert after every mixer: Kimi-Linear's block.

On disk (the hub's names, which transformers renames on load): `model.word_embeddings`, `layers.i.attention.*`
with `attention.dense` for o_proj, `mlp.gate.expert_bias` for the router's correction bias; routed experts
`mlp.experts.{e}.{gate,up,down}_proj`. The multi-token-prediction layers the hub stores after the last layer
(`model.layers.N`, `model.mtp.*`) are skipped, as transformers skips them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM

_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class BailingBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.self_attn = build_mixer(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        ff = build_mlp(config, layer, dtype, router_name="gate", shared_name="shared_experts")
        if ff is None:
            raise ValueError(f"layer {layer}: Ling 3.0 blocks always have a feed-forward")
        self.mlp = ff

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, caches, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class BailingHybridForCausalLM(HybridForCausalLM):
    block_class = BailingBlock
    final_norm_name = "norm"

    def rename_checkpoint_key(self, key: str) -> str | None:  # type: ignore[override]
        layer = _LAYER.match(key)
        if key.startswith("model.mtp.") or (layer is not None and int(layer.group(1)) >= self.config.num_layers):
            return None  # the multi-token-prediction layers
        for pattern, new in _RENAMES:
            key = pattern.sub(new, key)
        return key
