"""Kimi-Linear: Kimi Delta Attention layers with a few MLA layers (no positional encoding), a dense MLP or an
MoE with shared experts after every mixer.

Layout `model.{embed_tokens, layers.i.{self_attn, block_sparse_moe, input_layernorm, post_attention_layernorm},
norm}` + `lm_head`, as the checkpoints store it (`block_sparse_moe` for the dense MLP too; routed experts
`experts.{e}.{w1, w3, w2}`, router `gate` with `e_score_correction_bias`, `shared_experts`).
"""

from __future__ import annotations

import re

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm

_EXPERT_NAMES = re.compile(r"(\.experts\.\d+\.)w([123])\.")
_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


class KimiBlock(ResidualBlock):
    """Pre-norm mixer then feed-forward (dense or MoE with shared experts), the feed-forward under `ff_name`."""

    family, ff_name = "Kimi-Linear", "block_sparse_moe"

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.self_attn = build_mixer(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        ff = build_mlp(config, layer, dtype, router_name="gate", shared_name="shared_experts")
        if ff is None:
            raise ValueError(f"layer {layer}: {self.family} blocks always have a feed-forward")
        setattr(self, self.ff_name, ff)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = add_norm(self.input_layernorm, h, out)
        x, h = add_norm(self.post_attention_layernorm, h, self.self_attn(x, batch, caches, layer))
        return h, getattr(self, self.ff_name)(x)


class KimiLinearForCausalLM(HybridForCausalLM):
    block_class = KimiBlock
    final_norm_name = "norm"

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        return _EXPERT_NAMES.sub(lambda m: f"{m.group(1)}{_W[m.group(2)]}.", key)
