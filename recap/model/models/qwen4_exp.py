"""Qwen4-Exp (`Qwen4ExpForCausalLM`): Gated DeltaNet and QSA attention layers (layers/qsa_attention.py), an MoE
after each, hyper-connections around both (layers/gated_residual.py), no per-layer norms; some GDN layers
("gdn_ple") first add per-layer n-gram embeddings to the streams (layers/ple.py).

Each token carries N residual streams side by side ([T, N D]; N copies of its embedding at first). Layer i:
    S = S + w (x) mixer(attn_hyper_connection.mix(S));  S = S + w' (x) mlp(mlp_hyper_connection.mix(S))
then hyper_connection_mixer.mix(S) is the final hidden state (no final norm).
Layout `model.{embed_tokens, layers.i.{linear_attn | self_attn, mlp, attn_hyper_connection,
mlp_hyper_connection}, hyper_connection_mixer}` + `lm_head` (transformers' names; the MoE: router `gate`,
experts `experts.{e}.*`, `shared_expert`, `shared_expert_gate`).
Not a ResidualBlock (models/residual_block.py): hyper-connections, no per-layer norm for a residual add to feed.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.gated_residual import GatedResidual
from recap.model.layers.ple import PerLayerEmbedding
from recap.model.model_config import GatedResidualConfig, ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM

_PLE_BUFFERS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
                "ple_embedding.ngram_heads_offsets")  # fmt: skip


def _streams(config: ModelConfig) -> GatedResidualConfig:
    if config.gated_residual is None:
        raise ValueError("Qwen4-Exp blocks need gated_residual (its hyper-connections)")
    return config.gated_residual


class Qwen4ExpBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        hc, d, eps = _streams(config), config.hidden_size, config.norm_eps
        self.is_attention = config.layer_types[layer] == "attention"
        setattr(self, "self_attn" if self.is_attention else "linear_attn", build_mixer(config, layer, dtype))
        ff = build_mlp(config, layer, dtype, router_name="gate", shared_name="shared_expert")
        if ff is None:
            raise ValueError(f"layer {layer}: Qwen4-Exp blocks always have a feed-forward")
        self.mlp = ff
        self.attn_hyper_connection = GatedResidual(d, hc, eps, dtype)
        self.mlp_hyper_connection = GatedResidual(d, hc, eps, dtype)
        ple = config.gdn_ple.ple if config.layer_types[layer] == "gdn_ple" and config.gdn_ple is not None else None
        self.ple = None if ple is None else PerLayerEmbedding(d, ple, layer, eps, dtype)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        mixer = self.self_attn if self.is_attention else self.linear_attn
        if self.ple is not None:
            streams = self.ple(streams, batch, caches, layer)
        streams = self.attn_hyper_connection.around(streams, lambda x: mixer(x, batch, caches, layer))
        return self.mlp_hyper_connection.around(streams, self.mlp)


class Qwen4ExpForCausalLM(HybridForCausalLM):
    block_class = Qwen4ExpBlock
    final_norm_name = "hyper_connection_mixer"

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # the streams' last mixer stands where other families have their final norm
        self.model.hyper_connection_mixer = GatedResidual(
            config.hidden_size, _streams(config), config.norm_eps, dtype, inject=False
        )

    def rename_checkpoint_key(self, key: str) -> str | None:  # type: ignore[override]
        if key.endswith(_PLE_BUFFERS):
            return None  # the hash multipliers and table sizes: recomputed from the config (layers/ple.py)
        return key

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        streams = self.embed(batch.input_ids).repeat(1, _streams(self.config).streams)
        for i, block in enumerate(self.blocks()):
            streams = block(streams, batch, caches, i)
        return self.model.hyper_connection_mixer.mix(streams)


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The hub's vision-language checkpoint, loaded text-only: `model.language_model.*` is this model's `model.*`;
    the vision tower (`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped."""

    ignored_checkpoint_prefixes = ("model.visual.", "mtp.")

    def rename_checkpoint_key(self, key: str) -> str | None:  # type: ignore[override]
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        return super().rename_checkpoint_key(key)
