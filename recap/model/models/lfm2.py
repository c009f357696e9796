"""LFM2 (Liquid): gated short convolutions mixed with attention (q/k RMSNorm), a dense SwiGLU after every mixer.

Layout `model.{embed_tokens, layers.i.{conv | self_attn, feed_forward, operator_norm, ffn_norm},
embedding_norm}` (+ `lm_head` when untied). Block i: h += mixer(operator_norm(h)); h += ffn(ffn_norm(h));
the final norm is `embedding_norm`. LFM2-MoE and LFM3 reuse the block (see their files).
"""

from __future__ import annotations

import re

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, capture_residual, require_type
from recap.model.layer_kinds import build_mixer
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm

# On-disk names -> the shared layers' names (the MLP's and each expert's w1/w3/w2, LFM2's attention output and
# q/k norms, LFM2-MoE's router bias).
_MLP_NAMES = re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)w([123])\.")
_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".self_attn.gate_proj.", ".self_attn.g_proj."),  # LFM3's output gate, as save_pretrained names it
    (".feed_forward.expert_bias", ".feed_forward.gate.e_score_correction_bias"),  # LFM2-MoE's router bias
)


class LfmBlock(ResidualBlock):
    """`config.post_norms`: RMSNorms on the mixer's and the feed-forward's outputs too (LFM3's sandwich)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer] == "attention"
        mixer = build_mixer(config, layer, dtype)
        if self.is_attention:
            self.self_attn = mixer
        else:
            self.conv = mixer
        ff = build_mlp(config, layer, dtype, router_name="gate")
        if ff is None:
            raise ValueError(f"layer {layer}: LFM blocks always have a feed-forward")
        self.feed_forward = ff
        eps = config.norm_eps
        self.operator_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.ffn_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.sandwich = config.post_norms
        if self.sandwich:
            self.post_operator_norm = RMSNorm(config.hidden_size, eps, dtype)
            self.post_ffn_norm = RMSNorm(config.hidden_size, eps, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.self_attn if self.is_attention else self.conv
        x, h = add_norm(self.operator_norm, h, out)
        out = mixer(x, batch, caches, layer)
        x, h = add_norm(self.ffn_norm, h, self.post_operator_norm(out) if self.sandwich else out)
        out = self.feed_forward(x)
        return h, self.post_ffn_norm(out) if self.sandwich else out

    def capture_decode(self, builder: DecodeCapture, h: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record the mixer's and the feed-forward's residual steps on the residual buffer h (model/capture.py);
        LFM3's sandwich norms are not recorded."""
        require_type(self, LfmBlock, f"layer {layer}: block")
        if self.sandwich:
            raise GraphUnsupportedError(f"layer {layer}: an LFM block with post norms")
        capture_residual(builder, h, self.operator_norm, self.self_attn if self.is_attention else self.conv, caches,
                         layer)  # fmt: skip
        capture_residual(builder, h, self.ffn_norm, self.feed_forward, caches, layer)
        return h


class Lfm2ForCausalLM(HybridForCausalLM):
    block_class = LfmBlock
    final_norm_name = "embedding_norm"

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        key = _MLP_NAMES.sub(lambda m: f"{m.group(1)}{_W[m.group(2)]}.", key)
        for old, new in _RENAMES:
            if old in key:
                return key.replace(old, new)
        return key


class Lfm2VlForConditionalGeneration(Lfm2ForCausalLM):
    """The hub's vision-language checkpoint, loaded text-only: `model.language_model.*` is this model's `model.*`;
    the vision tower and its projector are skipped."""

    ignored_checkpoint_prefixes = ("model.vision_tower.", "model.multi_modal_projector.")

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        return Lfm2ForCausalLM.rename_checkpoint_key(key)
