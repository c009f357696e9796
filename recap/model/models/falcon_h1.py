"""Falcon-H1 (FalconH1ForCausalLM): attention and Mamba2 side by side in every layer ("hybrid"), then a
gated MLP. Its multipliers are config fields that the shared layers apply: the embedding and lm_head
multipliers (ModelConfig), the attention in/out multipliers and key multiplier (AttentionConfig: the key
one is folded into the softmax scale), the SSM in/out multipliers and the per-part in_proj "mup vector"
(Mamba2Config), the MLP gate/down multipliers (MLPConfig).

Layout `model.{embed_tokens, layers.i.{input_layernorm, mamba, self_attn, pre_ff_layernorm, feed_forward},
final_layernorm}` + `lm_head`: layer i owns both a KV cache and a part of the state slot.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.attention import Attention
from recap.model.layers.mamba2 import Mamba2Mixer
from recap.model.layers.mlp import MLP
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm


class FalconH1Block(ResidualBlock):
    """x = norm(h);  h += mamba(x) + attn(x);  h += mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        if config.layer_types[layer] != "hybrid" or config.mamba2 is None or config.mlp is None:
            raise ValueError(f"Falcon-H1 layer {layer} must be a hybrid layer with a Mamba2 and an MLP config")
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.norm_eps, dtype)
        self.mamba = Mamba2Mixer(h, config.mamba2, dtype)
        self.self_attn = Attention(h, config.attention_for(layer), dtype)
        self.pre_ff_layernorm = RMSNorm(h, config.norm_eps, dtype)
        self.feed_forward = MLP(h, config.mlp, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = add_norm(self.input_layernorm, h, out)
        mixed = self.mamba(x, batch, caches, layer) + self.self_attn(x, batch, caches, layer)
        x, h = add_norm(self.pre_ff_layernorm, h, mixed)
        return h, self.feed_forward(x)


class FalconH1ForCausalLM(HybridForCausalLM):
    block_class = FalconH1Block
