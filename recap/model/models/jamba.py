"""Jamba: Mamba1 layers (with dt/B/C RMS norms) and attention layers without RoPE; MoE every other layer.

On disk the experts are per-expert `feed_forward.experts.{e}.{gate,up,down}_proj.weight` and the
router is `feed_forward.router.weight`, which is exactly the shared hybrid layout with SparseMoE.
"""

from __future__ import annotations

from recap.model.models.hybrid import HybridForCausalLM


class JambaForCausalLM(HybridForCausalLM):
    """Layout and forward are the shared hybrid ones; `layer_types`/`mlp_types` come from the periods."""
