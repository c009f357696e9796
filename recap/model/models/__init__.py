"""Model families by HF architecture name (each translator in config.py has an entry here)."""

from __future__ import annotations

from recap.model.models.bamba import BambaForCausalLM
from recap.model.models.base import CausalLM
from recap.model.models.jamba import JambaForCausalLM
from recap.model.models.kimi_linear import KimiLinearForCausalLM
from recap.model.models.lfm2 import Lfm2ForCausalLM
from recap.model.models.lfm2_moe import Lfm2MoeForCausalLM
from recap.model.models.lfm3 import Lfm3ForCausalLM
from recap.model.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM"]
