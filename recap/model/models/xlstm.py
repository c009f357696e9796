"""xLSTM (xLSTMForCausalLM, xLSTM-7B's layout): `backbone.{embeddings, blocks.i.{norm_mlstm, mlstm_layer, norm_ffn,
ffn}, out_norm}` + `lm_head`, RMS norms throughout:
  h = h + mlstm_layer(norm_mlstm(h));  h = h + ffn(norm_ffn(h))
then out_norm (transformers applies it whatever add_out_norm says) and the logits soft-capped
(output_logit_soft_cap, ModelConfig.logits_soft_cap). The mLSTM layer reads the layer's state slot part.
Each residual add runs with the norm after it, fused where the kernel set can (models/residual_block.py).
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear
from recap.model.layers.xlstm import XlstmFeedForward, XlstmRMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm


class XlstmBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config.xlstm
        if cfg is None:
            raise ValueError("an xLSTM block needs config.xlstm")
        d = config.hidden_size
        self.norm_mlstm = XlstmRMSNorm(d, config.norm_eps, cfg.use_bias, cfg.force_float32_norm, dtype)
        self.mlstm_layer = build_mixer(config, layer, dtype)  # MlstmLayer
        self.norm_ffn = XlstmRMSNorm(d, config.norm_eps, cfg.use_bias, cfg.force_float32_norm, dtype)
        self.ffn = XlstmFeedForward(d, cfg.ffn_size, cfg, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = add_norm(self.norm_mlstm, h, out)
        x, h = add_norm(self.norm_ffn, h, self.mlstm_layer(x, batch, caches, layer))
        return h, self.ffn(x)


class xLSTMForCausalLM(CausalLM):  # noqa: N801 (transformers' architecture name)
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.backbone = nn.Module()
        self.backbone.embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.backbone.blocks = nn.ModuleList(XlstmBlock(config, i, dtype) for i in range(config.num_layers))
        self.backbone.out_norm = XlstmRMSNorm(config.hidden_size, config.norm_eps, False, True, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)

    def embedding(self) -> Embedding:
        return self.backbone.embeddings

    def blocks(self) -> nn.ModuleList:
        return self.backbone.blocks

    def final_norm(self) -> nn.Module:
        return self.backbone.out_norm
