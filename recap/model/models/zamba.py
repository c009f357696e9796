"""Zamba (ZambaForCausalLM, v1): Zamba2's layout (models/zamba2.py) over multi-head Mamba1 layers
(layers/mamba1_heads.py): at the "hybrid_mamba1" layers one shared transformer block (no adapters, no RoPE,
an unfused gated MLP) runs on [h | the token embeddings], its output projected by the layer's own `linear`
and added to the Mamba layer's input. On disk the block is `model.layers.{first hybrid}.shared_transf.*`
(every use's own copy when tie_word_embeddings is false, as transformers ties them only then).
"""

from __future__ import annotations

from recap.model.models.zamba2 import HybridLayer, Zamba2ForCausalLM


class ZambaHybridLayer(HybridLayer):
    block_name = "shared_transf"


class ZambaForCausalLM(Zamba2ForCausalLM):
    hybrid_kind, mamba_kind = "hybrid_mamba1", "mamba1"
    hybrid_layer = ZambaHybridLayer
