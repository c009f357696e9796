"""Nemotron-H and Nemotron-3 (NemotronHForCausalLM): one mixer per layer, Mamba2, attention (no RoPE),
a relu2 MLP or a MoE, each as `backbone.layers.i.{norm, mixer}`: the Mamba layout.

On disk (save_pretrained's legacy layout) the MoE is `mixer.gate.{weight, e_score_correction_bias}`,
per-expert `mixer.experts.{e}.{up,down}_proj.weight` and `mixer.shared_experts.{up,down}_proj.weight`.
The multi-token-prediction head (Nemotron-3 Super / Nano, where `num_nextn_predict_layers` > 0) is skipped by
declared prefix (counted, logged) and read only by speculative method "mtp" (model/mtp_load.py):
`mtp.layers.{b}.{norm, mixer.*}` for each block b of `mtp_layers_block_type` (attention, then a MoE by default),
the fusion `enorm`, `hnorm`, `eh_proj` on block 0 and `final_layernorm` on the last block (vLLM's nemotron_h_mtp
reads the same names). Each block is a layer of this layout: h + mixer(norm(h)).
"""

from __future__ import annotations

import re

from recap.model.models.mamba import MambaForCausalLM

_MTP_BLOCK = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_FUSION = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}


class NemotronHForCausalLM(MambaForCausalLM):
    moe_names = {"router_name": "gate"}  # noqa: RUF012 (read only)
    ignored_checkpoint_prefixes = ("mtp.",)

    def mtp_weight_name(self, key: str) -> str | None:
        m = _MTP_BLOCK.match(key)
        if m is None:
            return None
        block, rest = int(m.group(1)), m.group(2)
        part, _, param = rest.partition(".")
        if block == 0 and part in _MTP_FUSION:
            return f"{_MTP_FUSION[part]}.{param}"
        if block == len(self.config.mtp_layer_types) - 1 and part == "final_layernorm":
            return f"norm.{param}"
        return f"layers.{block}.{rest}"  # a block's own weights (a misplaced fusion or norm: an unexpected key)


# What the Omni checkpoints hold besides the language model, none of it used text-only: the RADIO vision tower and
# its projector, the Parakeet audio tower and its projector, each under the hub's name (what save_pretrained
# writes) and transformers' in-memory one; the vision norm only MTP-carrying checkpoints build.
_OMNI_TOWERS = ("vision_model.", "mlp1.", "multi_modal_projector.", "vision_final_layernorm.",
                "sound_encoder.", "sound_projection.", "audio_tower.", "embed_audio.")  # fmt: skip


class NemotronH_Omni_Reasoning_V3(NemotronHForCausalLM):  # noqa: N801 (transformers' class name)
    """Nemotron-3 Nano Omni, loaded text-only: `language_model.*` is a NemotronHForCausalLM checkpoint (its MTP
    head skipped, and read for method "mtp", as there); the vision and audio towers and their projectors are
    skipped by name."""

    ignored_checkpoint_prefixes = (*_OMNI_TOWERS, "language_model.mtp.")

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        if not key.startswith("language_model."):
            return "(outside language_model) " + key  # no weight of the text model's: the loader refuses it
        return NemotronHForCausalLM.rename_checkpoint_key(key.removeprefix("language_model."))

    def mtp_weight_name(self, key: str) -> str | None:
        if not key.startswith("language_model."):
            return None
        return super().mtp_weight_name(key.removeprefix("language_model."))
