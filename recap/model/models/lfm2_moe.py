"""LFM2-MoE: LFM2's blocks with a sparse MoE after the mixer past the first `num_dense_layers` layers.

The MoE: sigmoid router (`feed_forward.gate`) with a correction bias (`feed_forward.expert_bias` on disk)
choosing top-k, weights renormalized, experts `feed_forward.experts.{e}.{w1, w3, w2}` as on disk.
"""

from __future__ import annotations

from recap.model.models.lfm2 import Lfm2ForCausalLM


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """Layout and forward are LFM2's; `mlp_types` says which layers are MoE."""
