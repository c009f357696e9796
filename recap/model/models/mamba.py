"""Mamba, FalconMamba, Mamba2 and Nemotron-H: `backbone.{embeddings, layers.i.{norm, mixer}, norm_f}` + `lm_head`.

They differ only in the mixer of each layer (chosen by `layer_types` / `mlp_types`) and in FalconMamba's
dt/B/C norms (a Mamba1Config field), so one layout serves them all. A Nemotron-H layer's "mixer" may be an
MLP or a MoE (layer type "none"): h + mlp(norm(h)).
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


class MixerBlock(ResidualBlock):
    """h + mixer(norm(h)); the residual stream is kept in fp32 when `residual_in_fp32`."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, **moe_names: str) -> None:
        super().__init__()
        self.dtype, self.residual_in_fp32 = dtype, config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        if config.layer_types[layer] == "none":
            mlp = build_mlp(config, layer, dtype, **moe_names)
            if mlp is None:
                raise ValueError(f"layer {layer} has neither a mixer nor an MLP")
            self.mixer = mlp
        else:
            if config.mlp_types[layer] != "none":
                raise ValueError(f"layer {layer}: this layout has one mixer per layer, no MLP after it")
            self.mixer = build_mixer(config, layer, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.residual_in_fp32 and self.dtype != torch.float32:  # an fp32 stream whose norm reads its cast
            h = h.float() if out is None else h + out
            return h, self.mixer(self.norm(h.to(self.dtype)), batch, caches, layer)
        x, h = add_norm(self.norm, h, out)
        return h, self.mixer(x, batch, caches, layer)

    def capture_decode(self, builder: DecodeCapture, h: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record h += mixer(norm(h)) on the residual buffer h (model/capture.py); returns h."""
        require_type(self, MixerBlock, f"layer {layer}: block")
        capture_residual(builder, h, self.norm, self.mixer, caches, layer)
        return h


class MambaForCausalLM(CausalLM):
    moe_names: dict[str, str] = {}  # noqa: RUF012 (read only) the MoE parts' names on disk

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.backbone = nn.Module()
        self.backbone.embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.backbone.layers = nn.ModuleList(self.build_layers(config, dtype))
        self.backbone.norm_f = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)

    def build_layers(self, config: ModelConfig, dtype: torch.dtype) -> list[nn.Module]:
        return [MixerBlock(config, i, dtype, **self.moe_names) for i in range(config.num_layers)]

    def embedding(self) -> Embedding:
        return self.backbone.embeddings

    def blocks(self) -> nn.ModuleList:
        return self.backbone.layers

    def final_norm(self) -> RMSNorm:
        return self.backbone.norm_f

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        # Older Mamba conversions name the embedding `embedding` (HF's load hook renames it too).
        return key.replace("backbone.embedding.", "backbone.embeddings.")


# The families sharing this layout.
FalconMambaForCausalLM = MambaForCausalLM
Mamba2ForCausalLM = MambaForCausalLM
