"""OLMo-Hybrid: Gated DeltaNet layers (pre-norm) with attention layers (post-norm, OLMo-3 style).

Layout `model.{embed_tokens, layers.i.*, norm}` + `lm_head`; plain (w) RMSNorms.
  GDN block i:        h += linear_attn(input_layernorm(h));  h += mlp(post_attention_layernorm(h))
  attention block i:  h += post_attention_layernorm(self_attn(h));  h += post_feedforward_layernorm(mlp(h))
Attention RMS-norms q and k over all heads at once (AttentionConfig.qk_norm "all"), no output gate; RoPE
when the config has a rope_theta, none otherwise. The checkpoint's multi-token-prediction head (`mtp.*`)
is skipped by declared prefix (counted and logged); the checkpoint's OLMo-core norm names are renamed.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.gated_attention import GatedAttention
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm, settle


class OlmoHybridBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        self.is_attention = config.layer_types[layer] == "attention"
        if self.is_attention and config.attention is not None:
            self.self_attn = GatedAttention(d, config.attention, eps, dtype)
            self.post_feedforward_layernorm = RMSNorm(d, eps, dtype)
        else:
            self.linear_attn = build_mixer(config, layer, dtype)
            self.input_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = build_mlp(config, layer, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_attention:  # norms after the attention and the MLP: no add feeds a norm
            h = settle(h, out)
            h = h + self.post_attention_layernorm(self.self_attn(h, batch, caches, layer))
            return h, self.post_feedforward_layernorm(self.mlp(h))
        x, h = add_norm(self.input_layernorm, h, out)
        x, h = add_norm(self.post_attention_layernorm, h, self.linear_attn(x, batch, caches, layer))
        return h, self.mlp(x)


# On disk (OLMo-core names) -> this layout (transformers' names); transformers renames them the same way.
_NORM_NAMES = (
    (".attention_layer_norm.", ".input_layernorm."),
    (".feedforward_layer_norm.", ".post_attention_layernorm."),
)


class OlmoHybridForCausalLM(HybridForCausalLM):
    ignored_checkpoint_prefixes = ("mtp.",)

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        for disk, ours in _NORM_NAMES:
            key = key.replace(disk, ours)
        return key

    block_class = OlmoHybridBlock
    final_norm_name = "norm"
