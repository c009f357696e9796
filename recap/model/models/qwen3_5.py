"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers with a few gated-attention layers.

Layout `model.{embed_tokens, layers.i.*, norm}` + `lm_head`; block i:
  h += mixer(input_layernorm(h))      mixer = `linear_attn` (GDN) or `self_attn` (gated attention)
  h += mlp(post_attention_layernorm(h))   a dense MLP or a MoE (router `gate`, stacked experts, a shared
                                          expert behind `shared_expert_gate`)
Every RMSNorm here but GDN's output norm is zero-centred: (1 + w).
The hub's Qwen3.5 / 3.6 checkpoints are vision-language (`Qwen3_5*ForConditionalGeneration`): the language
model sits under `model.language_model.*`; it is loaded text-only, and the vision tower (`model.visual.*`)
and the multi-token-prediction head (`mtp.*`) are skipped by declared prefix (counted and logged); speculative
method "mtp" reads the head separately (model/mtp_load.py).
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, capture_residual, require_type
from recap.model.layer_kinds import build_mixer
from recap.model.layers.gated_attention import GatedAttention
from recap.model.layers.norm import OffsetRMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm

# Weights of the checkpoint that the text-only language model does not use (skipped, counted, logged; the MTP head
# is read by model/mtp_load.py when speculative method "mtp" asks for it).
NOT_LANGUAGE_MODEL = ("model.visual.", "mtp.")


class Qwen3_5Block(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer] == "attention"
        if self.is_attention and config.attention is not None:
            self.self_attn = GatedAttention(config.hidden_size, config.attention, config.norm_eps, dtype, OffsetRMSNorm)
        else:
            self.linear_attn = build_mixer(config, layer, dtype)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.mlp = build_mlp(config, layer, dtype, router_name="gate", shared_name="shared_expert")

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.self_attn if self.is_attention else self.linear_attn
        x, h = add_norm(self.input_layernorm, h, out)
        x, h = add_norm(self.post_attention_layernorm, h, mixer(x, batch, caches, layer))
        return h, self.mlp(x)

    def capture_decode(self, builder: DecodeCapture, h: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record the mixer's and the MLP's residual steps on the residual buffer h (model/capture.py); a MoE
        layer is not recorded."""
        require_type(self, Qwen3_5Block, f"layer {layer}: block")
        mixer = self.self_attn if self.is_attention else self.linear_attn
        capture_residual(builder, h, self.input_layernorm, mixer, caches, layer)
        capture_residual(builder, h, self.post_attention_layernorm, self.mlp, caches, layer)
        return h


class Qwen3_5ForCausalLM(HybridForCausalLM):
    ignored_checkpoint_prefixes = NOT_LANGUAGE_MODEL
    block_class = Qwen3_5Block
    final_norm_name = "norm"
    final_norm_class = OffsetRMSNorm

    def mtp_weight_name(self, key: str) -> str | None:
        return key.removeprefix("mtp.") if key.startswith("mtp.") else None  # the head's names are Qwen's


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Same layout; every layer's mlp is a MoE (the translator says so)."""


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Same layout; GDN projections fused per key head (in_proj_qkvz / in_proj_ba), MoE or dense per layer."""


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The hub's vision-language checkpoint, loaded text-only: `model.language_model.*` is this model's `model.*`."""

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        return "model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.") else key


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The MoE vision-language checkpoint, loaded text-only."""


# What the MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR checkpoints hold besides the language model, none of it used text-only:
# the SigLIP2 vision tower (its window-attention merger included) and the merger projecting into the text width;
# and, as in the Qwen3.5 checkpoints they are built from, a multi-token-prediction head if one was kept (`mtp.*`).
MINICPM_TOWERS = ("model.vision_tower.", "model.merger.", "mtp.")


class MiniCPMV4_6ForConditionalGeneration(Qwen3_5ForCausalLM):  # noqa: N801 (transformers' class name)
    """MiniCPM-V 4.6 (and 4.7, MiniCPM-OCR: the same layout), loaded text-only: `model.language_model.*` is a
    Qwen3.5 text model, `lm_head` on top (absent when tied); the vision tower and merger are skipped by name."""

    ignored_checkpoint_prefixes = MINICPM_TOWERS

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        if key.startswith("model.language_model."):
            return "model." + key.removeprefix("model.language_model.")
        if key == "lm_head.weight":
            return key
        return "(outside language_model) " + key  # no weight of the text model's: the loader refuses it


MiniCPMV4_7ForConditionalGeneration = MiniCPMV4_6ForConditionalGeneration
MiniCPMOcrForConditionalGeneration = MiniCPMV4_6ForConditionalGeneration
