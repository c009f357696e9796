"""RWKV-4 (RwkvForCausalLM): `rwkv.{embeddings, blocks.i.{pre_ln (layer 0), ln1, attention, ln2, feed_forward},
ln_out}` + `head`, LayerNorms throughout:
  h = pre_ln(h) (layer 0);  h = h + attention(ln1(h));  h = h + feed_forward(ln2(h));  h = h / 2 after every
  rescale_every-th layer (transformers' inference rescaling, RwkvConfig)
Both mixers read the layer's state slot part (layers/rwkv.py).
Not a ResidualBlock (models/residual_block.py): its norms are LayerNorms, which the fused add + RMS norm cannot run.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear
from recap.model.layers.rwkv import RwkvChannelMix
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM

FINAL_NORM_EPS = 1e-5  # transformers builds ln_out with LayerNorm's default eps, whatever the config says


class RwkvBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config.rwkv
        if cfg is None:
            raise ValueError("an RWKV block needs config.rwkv")
        d, eps = config.hidden_size, config.norm_eps
        if layer == 0:
            self.pre_ln = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.ln1 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = build_mixer(config, layer, dtype)  # RwkvTimeMix
        self.feed_forward = RwkvChannelMix(d, cfg, dtype, layer)
        self.halve = cfg.halves_after(layer)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        if hasattr(self, "pre_ln"):
            h = self.pre_ln(h)
        h = h + self.attention(self.ln1(h), batch, caches, layer)
        h = h + self.feed_forward(self.ln2(h), batch, caches, layer)
        return h / 2 if self.halve else h


class RwkvForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.rwkv = nn.Module()
        self.rwkv.embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.rwkv.blocks = nn.ModuleList(RwkvBlock(config, i, dtype) for i in range(config.num_layers))
        self.rwkv.ln_out = nn.LayerNorm(config.hidden_size, eps=FINAL_NORM_EPS, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)

    def embedding(self) -> Embedding:
        return self.rwkv.embeddings

    def blocks(self) -> nn.ModuleList:
        return self.rwkv.blocks

    def final_norm(self) -> nn.Module:
        return self.rwkv.ln_out

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        # transformers names the output projection `head` (CausalLM.head() is the accessor here)
        return "lm_head.weight" if key == "head.weight" else key
