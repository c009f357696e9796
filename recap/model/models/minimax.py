"""MiniMax (MiniMaxForCausalLM, MiniMax-Text-01): lightning attention layers (layers/lightning.py) and softmax
attention layers, a MoE in every layer, and residuals taken after the norms, scaled:
  x = input_layernorm(h);          h = x * attn_alpha + mixer(x) * attn_beta   (linear or full factors)
  x = post_attention_layernorm(h); h = x * mlp_alpha + moe(x) * mlp_beta.
As a ResidualBlock (models/residual_block.py) the stream is the scaled norm output and the pending output the
scaled branch: each `x * alpha + branch * beta` is the add the next norm takes (fused where the kernel set can).
On disk the MoE is Mixtral's: `block_sparse_moe.gate` and `experts.{e}.w1 / w3 / w2` (gate / up / down);
transformers' persistent decay buffers (slope_rate, query/key/diagonal_decay) are recomputed, not loaded.
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

_DECAY_BUFFERS = re.compile(r"\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_KEY = re.compile(r"(\.block_sparse_moe\.experts\.\d+\.)(w[123])(\.weight)$")


class MiniMaxBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        if config.minimax_factors is None:
            raise ValueError("MiniMax needs its residual factors")
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        lightning = config.layer_types[layer] == "lightning"
        self.self_attn = build_mixer(config, layer, dtype)  # LightningAttention or Attention
        mlp = build_mlp(config, layer, dtype, router_name="gate")
        if mlp is None:
            raise ValueError(f"MiniMax layer {layer} has no feed-forward")
        self.block_sparse_moe = mlp
        f = config.minimax_factors
        self.attn_factors = (f[2], f[3]) if lightning else (f[0], f[1])
        self.mlp_factors = (f[4], f[5])

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = add_norm(self.input_layernorm, h, out)[0]  # the residual restarts at the norm's output
        alpha, beta = self.attn_factors
        x = add_norm(self.post_attention_layernorm, x * alpha, self.self_attn(x, batch, caches, layer) * beta)[0]
        return x * self.mlp_factors[0], self.block_sparse_moe(x) * self.mlp_factors[1]


class MiniMaxForCausalLM(HybridForCausalLM):
    block_class = MiniMaxBlock
    final_norm_name = "norm"

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        if _DECAY_BUFFERS.search(key):
            return None  # functions of the layer index and block size (LightningConfig.slopes)
        return _EXPERT_KEY.sub(lambda m: m.group(1) + _EXPERT_NAMES[m.group(2)] + m.group(3), key)
