"""Inkling (Thinking Machines): every layer is a "conv_attention" layer, full or sliding-window attention with
short convs (layers/rel_bias_attention.py), then a dense SwiGLU or a sink MoE (layers/sink_moe.py).

Layout `model.{embed_tokens.{weight, embed_norm}, layers.i.{input_layernorm, self_attn, attn_sconv,
post_attention_layernorm, mlp, mlp_sconv}, norm}` + `lm_head` (never tied; rows may be padded past the
vocabulary). Block i: h += attn_sconv(self_attn(norm(h))); h += mlp_sconv(mlp(norm(h))). The embedding is
RMS-normed; the head reads h / logits_mup_width_multiplier (ModelConfig.logits_multiplier).
The multi-token-prediction layers (`model.mtp.*`) are skipped, as transformers skips them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear
from recap.model.layers.norm import RMSNorm
from recap.model.layers.rel_bias_attention import RelBiasAttention, ResidualShortConv
from recap.model.layers.sink_moe import ScaledMLP, SinkMoE
from recap.model.model_config import ModelConfig
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm


class NormedEmbedding(Embedding):
    """embed_norm(table[ids]): the table's rows RMS-normed by `embed_norm`."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden_size, dtype)
        self.embed_norm = RMSNorm(hidden_size, eps, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


class InklingBlock(ResidualBlock):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        convs = config.output_convs
        if config.layer_types[layer] != "conv_attention" or convs is None:
            raise ValueError(f"Inkling layer {layer} must be a conv_attention layer with output convs")
        d, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = RelBiasAttention(d, config.attention_for(layer), dtype, window=config.window_of(layer))  # type: ignore[arg-type]
        self.attn_sconv = ResidualShortConv(d, convs, dtype, "attn")
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        if config.mlp_types[layer] == "moe" and config.moe is not None:
            self.mlp: nn.Module = SinkMoE(d, config.moe, dtype)
        elif config.mlp_types[layer] == "dense" and config.mlp is not None:
            self.mlp = ScaledMLP(d, config.mlp, dtype)
        else:
            raise ValueError(f"Inkling layer {layer}: a dense or MoE feed-forward")
        self.mlp_sconv = ResidualShortConv(d, convs, dtype, "mlp")

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = add_norm(self.input_layernorm, h, out)
        out = self.attn_sconv(self.self_attn(x, batch, caches, layer), batch, caches, layer)
        x, h = add_norm(self.post_attention_layernorm, h, out)
        return h, self.mlp_sconv(self.mlp(x), batch, caches, layer)


class InklingForCausalLM(HybridForCausalLM):
    block_class = InklingBlock
    final_norm_name = "norm"
    ignored_checkpoint_prefixes = ("model.mtp.",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        rows = config.padded_vocab_size or config.vocab_size
        self.model.embed_tokens = NormedEmbedding(rows, config.hidden_size, config.norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, rows, False, dtype)


# Thinking Machines' names (the hub's checkpoints, as transformers' conversion mapping reads them) -> this layout.
_TML_NAMES = tuple((re.compile(p), r) for p, r in (
    (r"^model\.llm\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^model\.llm\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"^model\.llm\.unembed\.weight$", "lm_head.weight"),
    (r"^model\.llm\.", "model."),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."), (r"\.attn\.wk_dv\.", ".self_attn.k_proj."),
    (r"\.attn\.wv_dv\.", ".self_attn.v_proj."), (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."),
    (r"\.attn\.(q_norm|k_norm|rel_logits_proj)\.", r".self_attn.\1."),
    (r"\.attn\.(k_sconv|v_sconv)\.weight$", r".self_attn.\1.conv1d.weight"),
    (r"\.(attn_sconv|mlp_sconv)\.weight$", r".\1.conv1d.weight"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.mlp\.w13_dn\.weight$", ".mlp.gate_up_proj.weight"), (r"\.mlp\.w2_md\.weight$", ".mlp.down_proj.weight"),
    (r"\.experts\.w13_weight$", ".experts.gate_up_proj"), (r"\.experts\.w2_weight$", ".experts.down_proj"),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.shared_w13_weight$", ".gate_up_proj"), (r"\.shared_w2_weight$", ".down_proj"),
))  # fmt: skip


class InklingForConditionalGeneration(InklingForCausalLM):
    """The hub's checkpoint, loaded text-only: the text model under `model.llm.*` in Thinking Machines' names
    (renamed here; fused gate/up rows alternate, which the translator tells the feed-forwards); the vision and
    audio towers and the multi-token-prediction layers are skipped."""

    ignored_checkpoint_prefixes = ("model.visual.", "model.audio.", "model.mtp.")

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        for pattern, repl in _TML_NAMES:
            key = pattern.sub(repl, key)
        return key
