"""LFM3: LFM2's layout with sliding-window attention layers beside full ones, a sigmoid output gate per
attention head, per-layer-type RoPE (full: proportional, sliding: default) and sandwich norms
(`post_operator_norm`, `post_ffn_norm`). Sliding-window layers form the window cache group."""

from __future__ import annotations

from recap.model.models.lfm2 import Lfm2ForCausalLM


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Layout and forward are LFM2's; the config carries the windows, gates, RoPE and `post_norms`."""
