"""One translator per HF architecture, from its config.json dict to a `ModelConfig`, grouped by family.

Adding a family = one translator in a module here (registered below) + one model file in `models/`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from recap.model.config import ModelConfig
from recap.model.translators.gated_deltanet import _olmo_hybrid, _qwen3_5_vl, _qwen_gdn
from recap.model.translators.lfm_kimi import _kimi_linear, _lfm
from recap.model.translators.mamba import _bamba, _jamba, _mamba, _mamba2
from recap.model.translators.mamba2_hybrids import _falcon_h1, _granite_moe_hybrid, _nemotron_h, _zamba2

TRANSLATORS: dict[str, Callable[[Mapping[str, Any], str], ModelConfig]] = {
    "MambaForCausalLM": _mamba,
    "FalconMambaForCausalLM": _mamba,
    "Mamba2ForCausalLM": _mamba2,
    "BambaForCausalLM": _bamba,
    "JambaForCausalLM": _jamba,
    "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_moe_hybrid,
    "FalconH1ForCausalLM": _falcon_h1,
    "Qwen3_5ForCausalLM": _qwen_gdn,
    "Qwen3_5MoeForCausalLM": _qwen_gdn,
    "Qwen3NextForCausalLM": _qwen_gdn,
    "Qwen3_5ForConditionalGeneration": _qwen3_5_vl,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_vl,
    "OlmoHybridForCausalLM": _olmo_hybrid,
    "Zamba2ForCausalLM": _zamba2,
    "Lfm2ForCausalLM": _lfm,
    "Lfm2MoeForCausalLM": _lfm,
    "Lfm3ForCausalLM": _lfm,
    "KimiLinearForCausalLM": _kimi_linear,
}
# For configs that name no architecture.
MODEL_TYPES = {
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}
