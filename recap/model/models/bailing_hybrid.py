"""Ling 3.0 (`BailingHybridForCausalLM`; the hub's `BailingMoeV3ForCausalLM` / `BailingMoeV2_5ForCausalLM` are
aliases of it in the family registry):
KDA layers (full-rank f_proj / g_proj) with an MLA layer (RoPE, per-head output gate) closing each group, a dense
MLP or an MoE with a shared expert after every mixer: Kimi-Linear's block.

On disk (the hub's names, which transformers renames on load): `model.word_embeddings`, `layers.i.attention.*`
with `attention.dense` for o_proj, `mlp.gate.expert_bias` for the router's correction bias; routed experts
`mlp.experts.{e}.{gate,up,down}_proj`. The multi-token-prediction layers the hub stores after the last layer
(`model.layers.N`, `model.mtp.*`) are skipped, as transformers skips them; speculative method "mtp" reads module N
(models/nextn.py: its final norm is `final_layernorm`, as vLLM's bailing_mtp reads it).
"""

from __future__ import annotations

import re

from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.kimi_linear import KimiBlock
from recap.model.models.nextn import nextn_weight_name

_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class BailingBlock(KimiBlock):
    family, ff_name = "Ling 3.0", "mlp"


class BailingHybridForCausalLM(HybridForCausalLM):
    block_class = BailingBlock
    final_norm_name = "norm"

    def rename_checkpoint_key(self, key: str) -> str | None:  # type: ignore[override]
        layer = _LAYER.match(key)
        if key.startswith("model.mtp.") or (layer is not None and int(layer.group(1)) >= self.config.num_layers):
            return None  # the multi-token-prediction layers
        for pattern, new in _RENAMES:
            key = pattern.sub(new, key)
        return key

    def mtp_weight_name(self, key: str) -> str | None:
        return nextn_weight_name(key, self.config.num_layers, self.rename_checkpoint_key, "final_layernorm")
