"""Zaya (Zyphra's ZAYA1): every layer compressed convolutional attention (layers/cca.py, full or sliding) and a
top-1 MoE whose router state flows from layer to layer (layers/zaya_moe.py).

Layout `model.{embed_tokens, input_hidden_states_{scale,bias}, layers.i.{input_layernorm, self_attn,
post_attention_residual_scale, post_attention_layernorm, mlp, post_mlp_residual_scale}, norm}` + `lm_head`.
The residual stream is fp32 (transformers' residual_in_fp32): h = (embed + bias) * scale;
  a = self_attn(input_layernorm(h));  h = (a + a_bias) * a_scale + (h + r_bias) * r_scale   (residual scaling)
  m, r = mlp(post_attention_layernorm(h), r);  h = the same residual scaling of m onto h
Not a ResidualBlock (models/residual_block.py): each norm reads the fp32 sum rounded to the model dtype, not the sum.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.cca import CCAAttention
from recap.model.layers.linear import empty_param
from recap.model.layers.norm import RMSNorm
from recap.model.layers.zaya_moe import ZayaMoE
from recap.model.model_config import ModelConfig
from recap.model.models.hybrid import HybridForCausalLM


class ResidualScaling(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            setattr(self, name, empty_param(dim, dtype=dtype))

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = (out + self.hidden_states_bias) * self.hidden_states_scale
        return out + (residual + self.residual_bias) * self.residual_scale


class ZayaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        cca, moe = config.cca, config.moe
        if config.layer_types[layer] != "cca_attention" or cca is None or moe is None:
            raise ValueError(f"Zaya layer {layer}: a cca_attention layer with a MoE")
        d, eps = config.hidden_size, config.norm_eps
        self.dtype = dtype
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = CCAAttention(d, cca, config.attention_for(layer), dtype, window=config.window_of(layer))
        self.post_attention_residual_scale = ResidualScaling(d, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = ZayaMoE(d, cca.router_hidden_size, moe.num_experts, moe.intermediate_size, eps, layer == 0, dtype)
        self.post_mlp_residual_scale = ResidualScaling(d, dtype)

    def forward(self, h: torch.Tensor, router: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out = self.self_attn(self.input_layernorm(h.to(self.dtype)), batch, caches, layer)
        h = self.post_attention_residual_scale(out, h)
        out, router = self.mlp(self.post_attention_layernorm(h.to(self.dtype)), router)
        return self.post_mlp_residual_scale(out, h), router


class ZayaForCausalLM(HybridForCausalLM):
    block_class = ZayaBlock
    final_norm_name = "norm"

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.model.input_hidden_states_scale = empty_param(config.hidden_size, dtype=dtype)
        self.model.input_hidden_states_bias = empty_param(config.hidden_size, dtype=dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding()(ids)
        return ((h + self.model.input_hidden_states_bias) * self.model.input_hidden_states_scale).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The layers in order, each router reading the previous layer's router state."""
        h, router = self.embed(batch.input_ids), None
        for i, block in enumerate(self.blocks()):
            h, router = block(h, router, batch, caches, i)
        return self.final_norm()(h.to(self.dtype))
