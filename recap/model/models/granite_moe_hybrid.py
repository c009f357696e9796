"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba2 or attention (RoPE or NoPE) per layer, then a MoE
plus a shared gated MLP in every layer (the shared MLP alone in the dense variant, num_local_experts=0),
with the muP multipliers of ModelConfig (embedding, residual, logits; the attention one is its scale).

Layout `model.{embed_tokens, layers.i.{input_layernorm, mamba | self_attn, post_attention_layernorm,
block_sparse_moe, shared_mlp}, norm}` + `lm_head`. On disk the experts are stacked 3-D tensors named
`input_linear` ([E, 2I, H], gate rows first) and `output_linear`, the router `router.layer`, and the
shared MLP `input_linear` / `output_linear` too: renamed to the shared layers' names on load.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, capture_residual, require_type
from recap.model.layer_kinds import build_mixer
from recap.model.layers.mlp import MLP
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm

_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
    (".shared_mlp.input_linear.weight", ".shared_mlp.gate_up_proj.weight"),
    (".shared_mlp.output_linear.weight", ".shared_mlp.down_proj.weight"),
)


class GraniteBlock(ResidualBlock):
    """h += mixer(norm(h)) * r;  x = norm(h);  h += (moe(x) + shared_mlp(x)) * r."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        if config.mlp is None:
            raise ValueError("Granite 4.0-H needs the shared MLP's config")
        self.is_attention = config.layer_types[layer] == "attention"
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        setattr(self, "self_attn" if self.is_attention else "mamba", build_mixer(config, layer, dtype))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.shared_mlp = MLP(config.hidden_size, config.mlp, dtype)
        self.block_sparse_moe = build_mlp(config, layer, dtype) if config.mlp_types[layer] == "moe" else None

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.self_attn if self.is_attention else self.mamba
        r = self.residual_multiplier
        x, h = add_norm(self.input_layernorm, h, out)
        x, h = add_norm(self.post_attention_layernorm, h, mixer(x, batch, caches, layer) * r)
        ff = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            ff = self.block_sparse_moe(x) + ff
        return h, ff * r

    def capture_decode(self, builder: DecodeCapture, h: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record both residual steps, each branch times the residual multiplier, on the residual buffer h
        (model/capture.py). The dense variant only: the builder has no MoE (no family captures one)."""
        require_type(self, GraniteBlock, f"layer {layer}: block")
        if self.block_sparse_moe is not None:
            raise GraphUnsupportedError(f"layer {layer}: MoE {type(self.block_sparse_moe).__name__}")
        mixer = self.self_attn if self.is_attention else self.mamba
        r = self.residual_multiplier
        capture_residual(builder, h, self.input_layernorm, mixer, caches, layer, r)
        capture_residual(builder, h, self.post_attention_layernorm, self.shared_mlp, caches, layer, r)
        return h


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    block_class = GraniteBlock
    final_norm_name = "norm"

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        for old, new in _RENAMES:
            if key.endswith(old):
                return key[: -len(old)] + new
        return key
