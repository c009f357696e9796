"""LFM3: LFM2's layout with sliding-window attention layers beside full ones, a sigmoid output gate per
attention head, per-layer-type RoPE (full: proportional, sliding: default) and sandwich norms
(`post_operator_norm`, `post_ffn_norm`). Sliding-window layers form the window cache group."""

from __future__ import annotations

from recap.model.models.lfm2 import Lfm2ForCausalLM


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Layout and forward are LFM2's; the config carries the windows, gates, RoPE and `post_norms`."""


class Lfm3VlForConditionalGeneration(Lfm3ForCausalLM):
    """The hub's vision-language checkpoint, loaded text-only: `model.language_model.*` is this model's `model.*`;
    the vision tower and its projector are skipped."""

    ignored_checkpoint_prefixes = ("model.vision_tower.", "model.multi_modal_projector.")

    @staticmethod
    def rename_checkpoint_key(key: str) -> str:
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        return Lfm3ForCausalLM.rename_checkpoint_key(key)
