"""RecurrentGemma (RecurrentGemmaForCausalLM, Griffin): recurrent blocks (layers/rglru.py) and local
sliding-window attention (the window group), a biased gated-gelu MLP in every layer, Gemma's (1 + w) norms:
  h = h + temporal_block(temporal_pre_norm(h));  h = h + mlp_block(channel_pre_norm(h))
Embeddings are scaled by sqrt(hidden) (rounded to bfloat16, as transformers does) and the logits soft-capped:
both are ModelConfig fields the translator sets.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.norm import OffsetRMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm


class RecurrentGemmaBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.temporal_pre_norm = OffsetRMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.temporal_block = build_mixer(config, layer, dtype)  # RecurrentBlock or (sliding-window) Attention
        self.channel_pre_norm = OffsetRMSNorm(config.hidden_size, config.norm_eps, dtype)
        mlp = build_mlp(config, layer, dtype)
        if mlp is None:
            raise ValueError(f"RecurrentGemma layer {layer} has no MLP")
        self.mlp_block = mlp

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = add_norm(self.temporal_pre_norm, h, out)
        x, h = add_norm(self.channel_pre_norm, h, self.temporal_block(x, batch, caches, layer))
        return h, self.mlp_block(x)


class RecurrentGemmaForCausalLM(HybridForCausalLM):
    block_class = RecurrentGemmaBlock
    final_norm_name = "final_norm"
    final_norm_class = OffsetRMSNorm
