"""Model families by HF architecture name (each translator in config.py has an entry here)."""

from __future__ import annotations

from recap.model.models.bamba import BambaForCausalLM
from recap.model.models.base import CausalLM
from recap.model.models.falcon_h1 import FalconH1ForCausalLM
from recap.model.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from recap.model.models.jamba import JambaForCausalLM
from recap.model.models.kimi_linear import KimiLinearForCausalLM
from recap.model.models.lfm2 import Lfm2ForCausalLM
from recap.model.models.lfm2_moe import Lfm2MoeForCausalLM
from recap.model.models.lfm3 import Lfm3ForCausalLM
from recap.model.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
from recap.model.models.nemotron_h import NemotronHForCausalLM
from recap.model.models.olmo_hybrid import OlmoHybridForCausalLM
from recap.model.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from recap.model.models.zamba2 import Zamba2ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM"]
