"""Bamba: Mamba2 layers with a few attention layers (partial RoPE), a dense gated MLP after every mixer."""

from __future__ import annotations

from recap.model.models.hybrid import HybridForCausalLM


class BambaForCausalLM(HybridForCausalLM):
    """Layout and forward are the shared hybrid ones; `layer_types` comes from `attn_layer_indices`."""
