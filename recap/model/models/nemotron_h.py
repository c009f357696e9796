"""Nemotron-H and Nemotron-3 (NemotronHForCausalLM): one mixer per layer, Mamba2, attention (no RoPE),
a relu2 MLP or a MoE, each as `backbone.layers.i.{norm, mixer}`: the Mamba layout.

On disk (save_pretrained's legacy layout) the MoE is `mixer.gate.{weight, e_score_correction_bias}`,
per-expert `mixer.experts.{e}.{up,down}_proj.weight` and `mixer.shared_experts.{up,down}_proj.weight`.
Multi-token-prediction weights (`mtp.*`) are not used by generation and are skipped by name.
"""

from __future__ import annotations

from recap.model.models.mamba import MambaForCausalLM


class NemotronHForCausalLM(MambaForCausalLM):
    moe_names = {"router_name": "gate"}  # noqa: RUF012 (read only)

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        return None if key.startswith("mtp.") else key


# What the Omni checkpoints hold besides the language model, none of it used text-only: the RADIO vision tower and
# its projector, the Parakeet audio tower and its projector, each under the hub's name (what save_pretrained
# writes) and transformers' in-memory one; the vision norm only MTP-carrying checkpoints build.
_OMNI_TOWERS = ("vision_model.", "mlp1.", "multi_modal_projector.", "vision_final_layernorm.",
                "sound_encoder.", "sound_projection.", "audio_tower.", "embed_audio.")  # fmt: skip


class NemotronH_Omni_Reasoning_V3(NemotronHForCausalLM):  # noqa: N801 (transformers' class name)
    """Nemotron-3 Nano Omni, loaded text-only: `language_model.*` is a NemotronHForCausalLM checkpoint (its MTP
    weights skipped as there); the vision and audio towers and their projectors are skipped by name."""

    ignored_checkpoint_prefixes = _OMNI_TOWERS

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        if not key.startswith("language_model."):
            return "(outside language_model) " + key  # no weight of the text model's: the loader refuses it
        return NemotronHForCausalLM.rename_checkpoint_key(key.removeprefix("language_model."))
