"""Attention + SSM hybrids laid out as `model.{embed_tokens, layers.i.*, final_layernorm}` + `lm_head`.

Block i: h += mixer(input_layernorm(h)), where the mixer is `mamba` (SSM layers) or `self_attn`;
then h += feed_forward(pre_ff_layernorm(h)), a dense MLP or a MoE (Bamba, Jamba).
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, capture_residual, require_type
from recap.model.layer_kinds import build_mixer
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM, build_mlp
from recap.model.models.residual_block import ResidualBlock, add_norm


class HybridBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer] == "attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        mixer = build_mixer(config, layer, dtype)
        if self.is_attention:
            self.self_attn = mixer
        else:
            self.mamba = mixer
        mlp = build_mlp(config, layer, dtype)
        if mlp is not None:
            self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
            self.feed_forward = mlp

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.self_attn if self.is_attention else self.mamba
        x, h = add_norm(self.input_layernorm, h, out)
        out = mixer(x, batch, caches, layer)
        if hasattr(self, "feed_forward"):
            x, h = add_norm(self.pre_ff_layernorm, h, out)
            out = self.feed_forward(x)
        return h, out

    def capture_decode(self, builder: DecodeCapture, h: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record the mixer's and the feed-forward's residual steps on the residual buffer h (model/capture.py)."""
        require_type(self, HybridBlock, f"layer {layer}: block")
        mixer = self.self_attn if self.is_attention else self.mamba
        capture_residual(builder, h, self.input_layernorm, mixer, caches, layer)
        if hasattr(self, "feed_forward"):
            capture_residual(builder, h, self.pre_ff_layernorm, self.feed_forward, caches, layer)
        return h


class HybridForCausalLM(CausalLM):
    """The `model.{embed_tokens, layers.i, <final norm>}` + `lm_head` layout most hybrids share; a family picks
    its block class, the name and class of its final norm, or overrides `build_layers`."""

    block_class: type[nn.Module] = HybridBlock
    final_norm_name = "final_layernorm"
    final_norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.model.layers = nn.ModuleList(self.build_layers(config, dtype))
        setattr(self.model, self.final_norm_name, self.final_norm_class(config.hidden_size, config.norm_eps, dtype))
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)

    def build_layers(self, config: ModelConfig, dtype: torch.dtype) -> list[nn.Module]:
        return [self.block_class(config, i, dtype) for i in range(config.num_layers)]

    def embedding(self) -> Embedding:
        return self.model.embed_tokens

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return getattr(self.model, self.final_norm_name)
