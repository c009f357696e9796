"""Inkling-2 (Thinking Machines): every layer a "conv_attention" layer (layers/inkling2.py), a MoE with
softcapped experts, and block attention residuals: each sublayer reads a learned attention over the states
that closed earlier blocks of `attention_residual_block` layers and the current partial state (per token).

Layer i (HF's Inkling2{Sliding,Full}DecoderLayer): x = attention_input(blocks, h) (3 queries in full layers:
the q, k and v streams; none in layer 0: h); a = attn_sconv(attn(norm(x))); at a block boundary (i % n == 0)
h closes a block and the layer's residual restarts at a, else it is h + a; then
+ mlp_sconv(mlp(mlp_norm(mlp_input(blocks, residual)))). The model ends with final_input(blocks, h), the norm
and a soft-capped head. Weights keep Thinking Machines' names (`model.llm.*`), as transformers saves them.
Not a ResidualBlock (models/residual_block.py): each norm reads an attention over block states, not the residual sum.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.inkling2 import BlockAttentionResidual, Inkling2Attention
from recap.model.layers.linear import Linear
from recap.model.layers.moe import SparseMoE
from recap.model.layers.norm import RMSNorm
from recap.model.layers.rel_bias_attention import ResidualShortConv
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM
from recap.model.models.inkling import NormedEmbedding


def _next_layer_query(m: re.Match[str]) -> str:
    """attn_res.attn_queries.N is layer N + 1's (layer 0 has none)."""
    return f"model.llm.layers.{int(m[1]) + 1}.attention_input.query"


_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"^model\.llm\.unembed\.weight$", "lm_head.weight"),
    (r"^model\.llm\.embed_norm\.", "model.llm.embed.embed_norm."),
    (r"^model\.llm\.attn_res\.attn_queries\.(\d+)$", _next_layer_query),
    (r"^model\.llm\.attn_res\.mlp_queries\.(\d+)$", r"model.llm.layers.\1.mlp_input.query"),
    (r"^model\.llm\.attn_res\.output_query$", "model.llm.final_input.query"),
    (r"\.(attn_sconv|mlp_sconv|k_sconv|v_sconv)\.weight$", r".\1.conv1d.weight"),
    (r"\.experts\.w13_weight$", ".experts.gate_up_proj"), (r"\.experts\.w2_weight$", ".experts.down_proj"),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
))  # fmt: skip


class Inkling2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        convs, moe, n = config.output_convs, config.moe, config.attention_residual_block
        if config.layer_types[layer] != "conv_attention" or convs is None or moe is None or n < 1:
            raise ValueError(f"Inkling-2 layer {layer}: a conv_attention layer with output convs, a MoE and blocks")
        d, eps = config.hidden_size, config.norm_eps
        self.full = not config.window_of(layer)
        self.boundary = layer % n == 0
        if layer:
            self.attention_input = BlockAttentionResidual(d, 3 if self.full else 1, dtype)
        self.mlp_input = BlockAttentionResidual(d, 1, dtype)
        self.attn = Inkling2Attention(d, config.attention_for(layer), dtype, window=config.window_of(layer))  # type: ignore[arg-type]
        for name in ("q_input_norm", "k_input_norm", "v_input_norm") if self.full else ("attn_norm",):
            setattr(self, name, RMSNorm(d, eps, dtype))
        self.attn_sconv = ResidualShortConv(d, convs, dtype, "attn")
        self.mlp_norm = RMSNorm(d, eps, dtype)
        self.mlp = SparseMoE(d, moe, dtype, router_name="gate")
        self.mlp_sconv = ResidualShortConv(d, convs, dtype, "mlp")

    def forward(self, h: torch.Tensor, blocks: list[torch.Tensor], batch: ForwardBatch, caches: ModelCaches,
                layer: int) -> torch.Tensor:  # fmt: skip
        streams = self.attention_input(blocks, h) if hasattr(self, "attention_input") else (h,)
        if self.full:
            xq, xk, xv = streams if len(streams) == 3 else streams * 3
            a = self.attn(self.q_input_norm(xq), batch, caches, layer, self.k_input_norm(xk), self.v_input_norm(xv))
        else:
            a = self.attn(self.attn_norm(streams[0]), batch, caches, layer)
        a = self.attn_sconv(a, batch, caches, layer).float()
        own = [*blocks, h] if self.boundary else blocks
        residual = a if self.boundary else h.float() + a
        x = self.mlp_input(own, residual.to(h.dtype))[0]
        m = self.mlp_sconv(self.mlp(self.mlp_norm(x)), batch, caches, layer)
        return (residual + m.float()).to(h.dtype)


class Inkling2ForCausalLM(CausalLM):
    ignored_checkpoint_prefixes = ("model.mtp.", "model.llm.mtp.")

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        d, rows = config.hidden_size, config.padded_vocab_size or config.vocab_size
        self.model = nn.Module()
        self.model.llm = nn.Module()
        self.model.llm.embed = NormedEmbedding(rows, d, config.norm_eps, dtype)
        self.model.llm.layers = nn.ModuleList(Inkling2Block(config, i, dtype) for i in range(config.num_layers))
        self.model.llm.final_input = BlockAttentionResidual(d, 1, dtype)
        self.model.llm.norm = RMSNorm(d, config.norm_eps, dtype)
        self.lm_head = Linear(d, rows, False, dtype)

    def embedding(self) -> NormedEmbedding:
        return self.model.llm.embed

    def blocks(self) -> nn.ModuleList:
        return self.model.llm.layers

    def final_norm(self) -> RMSNorm:
        return self.model.llm.norm

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        for pattern, repl in _RENAMES:
            key = pattern.sub(repl, key)
        return key

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.embed(batch.input_ids)
        blocks: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks()):
            new = block(h, blocks, batch, caches, i)
            if block.boundary:
                blocks = [*blocks, h]
            h = new
        return self.final_norm()(self.model.llm.final_input(blocks, h)[0])


class Inkling2ForConditionalGeneration(Inkling2ForCausalLM):
    """The hub's multimodal checkpoint, loaded text-only: the same `model.llm.*` text model (the translator reads
    its `text_config`); the vision tower and the multi-token-prediction layers are skipped."""

    ignored_checkpoint_prefixes = ("model.visual.", "model.vision_tower.", "model.mtp.", "model.llm.mtp.")
