"""The config API in one import: HF `config.json` -> frozen `ModelConfig`, and every config class it holds.

The parts live apart so that none imports another in a circle: the mixer configs (mixer_configs.py) and the
feed-forward configs (feed_forward_configs.py), the layer-kind table (layer_kinds.py), `ModelConfig`
(model_config.py), the translators (translators/), the family registry (families.py) and the reading of a
config.json (hf_config.py). A family on existing layer kinds = one translator + one model file + one
families.py entry.
"""

from __future__ import annotations

from recap.model.families import TRANSLATORS, UnsupportedArchitectureError
from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.hf_config import architecture_of, load_config, read_hf_config, translate_config
from recap.model.layer_kinds import LAYER_TYPES
from recap.model.mixer_configs import (
    AttentionConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    Mamba1Config,
    Mamba2Config,
    MLAConfig,
    ShortConvConfig,
)
from recap.model.model_config import ModelConfig, SharedBlocksConfig

__all__ = [
    "LAYER_TYPES",
    "TRANSLATORS",
    "AttentionConfig",
    "GatedDeltaNetConfig",
    "KDAConfig",
    "MLAConfig",
    "MLPConfig",
    "Mamba1Config",
    "Mamba2Config",
    "MoEConfig",
    "ModelConfig",
    "SharedBlocksConfig",
    "ShortConvConfig",
    "UnsupportedArchitectureError",
    "architecture_of",
    "load_config",
    "read_hf_config",
    "translate_config",
]
