"""The model families recap runs, one entry per HF architecture name: its translator, its model class, the
`model_type`s that name it and its tiny test checkpoint.

`TRANSLATORS`, `MODEL_TYPES`, `MODEL_CLASSES` (models/__init__.py) and `TINY_ARCHS` (testing.py) are views of
`FAMILIES`. Model classes are imported only when asked for (`Family.model_class`), so reading a config imports
no layer. A family on existing layer kinds = a translator (translators/), one model file (models/) and one
entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recap.model.model_config import ModelConfig
from recap.model.translators.common import UnsupportedArchitectureError
from recap.model.translators.gated_deltanet import _olmo_hybrid, _qwen3_5_vl, _qwen_gdn
from recap.model.translators.lfm_kimi import _kimi_linear, _lfm
from recap.model.translators.mamba import _bamba, _jamba, _mamba, _mamba2
from recap.model.translators.mamba2_hybrids import _falcon_h1, _granite_moe_hybrid, _nemotron_h, _zamba2

if TYPE_CHECKING:
    from recap.model.models.base import CausalLM

Translator = Callable[[Mapping[str, Any], str], ModelConfig]


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json `architectures[0]`, and the name of the model class
    translator: Translator  # (HF config dict, architecture) -> ModelConfig
    module: str  # the module under recap.model.models defining the class `architecture`
    model_types: tuple[str, ...]  # config.json `model_type`s naming this architecture (configs without one)
    tiny: str  # short name of its tiny random checkpoint (recap.model.testing)

    def model_class(self) -> type[CausalLM]:
        return getattr(importlib.import_module(f"recap.model.models.{self.module}"), self.architecture)


FAMILIES: tuple[Family, ...] = (
    Family("MambaForCausalLM", _mamba, "mamba", ("mamba",), "mamba"),
    Family("FalconMambaForCausalLM", _mamba, "mamba", ("falcon_mamba",), "falcon_mamba"),
    Family("Mamba2ForCausalLM", _mamba2, "mamba", ("mamba2",), "mamba2"),
    Family("BambaForCausalLM", _bamba, "bamba", ("bamba",), "bamba"),
    Family("JambaForCausalLM", _jamba, "jamba", ("jamba",), "jamba"),
    Family("NemotronHForCausalLM", _nemotron_h, "nemotron_h", ("nemotron_h",), "nemotron_h"),
    Family("GraniteMoeHybridForCausalLM", _granite_moe_hybrid, "granite_moe_hybrid", ("granitemoehybrid",),
           "granite_hybrid"),  # fmt: skip
    Family("FalconH1ForCausalLM", _falcon_h1, "falcon_h1", ("falcon_h1",), "falcon_h1"),
    Family("Qwen3_5ForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_5_text",), "qwen3_5"),
    Family("Qwen3_5MoeForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_5_moe_text",), "qwen3_5_moe"),
    Family("Qwen3NextForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_next",), "qwen3_next"),
    Family("Qwen3_5ForConditionalGeneration", _qwen3_5_vl, "qwen3_5", ("qwen3_5",), "qwen3_5_vl"),
    Family("Qwen3_5MoeForConditionalGeneration", _qwen3_5_vl, "qwen3_5", ("qwen3_5_moe",), "qwen3_5_moe_vl"),
    Family("OlmoHybridForCausalLM", _olmo_hybrid, "olmo_hybrid", ("olmo_hybrid",), "olmo_hybrid"),
    Family("Zamba2ForCausalLM", _zamba2, "zamba2", ("zamba2",), "zamba2"),
    Family("Lfm2ForCausalLM", _lfm, "lfm2", ("lfm2",), "lfm2"),
    Family("Lfm2MoeForCausalLM", _lfm, "lfm2_moe", ("lfm2_moe",), "lfm2_moe"),
    Family("Lfm3ForCausalLM", _lfm, "lfm3", ("lfm3",), "lfm3"),
    Family("KimiLinearForCausalLM", _kimi_linear, "kimi_linear", ("kimi_linear",), "kimi_linear"),
)
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}

# The views the rest of recap reads.
TRANSLATORS: dict[str, Translator] = {f.architecture: f.translator for f in FAMILIES}
MODEL_TYPES: dict[str, str] = {t: f.architecture for f in FAMILIES for t in f.model_types}  # configs naming none
TINY_ARCHS: dict[str, str] = {f.tiny: f.architecture for f in FAMILIES}  # short test name -> architecture


def family(architecture: str) -> Family:
    """The family of `architecture`; UnsupportedArchitectureError (listing the supported ones) if recap has none."""
    found = BY_ARCHITECTURE.get(architecture)
    if found is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture}; supported: {', '.join(sorted(BY_ARCHITECTURE))}"
        )
    return found
