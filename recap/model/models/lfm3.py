"""LFM3: LFM2's layout with sliding-window attention layers beside full ones, a sigmoid output gate per
attention head, per-layer-type RoPE (full: proportional, sliding: default) and sandwich norms
(`post_operator_norm`, `post_ffn_norm`). Sliding-window layers form the window cache group."""

from __future__ import annotations

from recap.model.models.lfm2 import Lfm2ForCausalLM, Lfm2VlForConditionalGeneration


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Layout and forward are LFM2's; the config carries the windows, gates, RoPE and `post_norms`."""


class Lfm3VlForConditionalGeneration(Lfm2VlForConditionalGeneration, Lfm3ForCausalLM):
    """The hub's vision-language checkpoint, loaded text-only: LFM2-VL's key layout (its `language_model` prefix and
    skipped towers) over LFM3's model."""
