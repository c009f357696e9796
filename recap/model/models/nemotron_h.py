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
