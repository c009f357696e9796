"""HF `config.json` -> `ModelConfig`: find the architecture's family (families.py) and run its translator."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recap.model.families import MODEL_TYPES, TRANSLATORS, family
from recap.model.model_config import ModelConfig

__all__ = ["MODEL_TYPES", "TRANSLATORS", "architecture_of", "load_config", "read_hf_config", "translate_config"]


def architecture_of(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
    elif cfg.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[cfg["model_type"]]
    else:
        arch = f"model_type={cfg.get('model_type')!r}"
    return family(arch).architecture


def translate_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF config dict (as read from config.json) into a ModelConfig."""
    arch = architecture_of(cfg)
    return family(arch).translator(cfg, arch)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model folder (Python's json accepts the bare `Infinity` literal)."""
    p = Path(path)
    with open(p / "config.json" if p.is_dir() else p) as f:
        return json.load(f)


def load_config(path: str | Path) -> ModelConfig:
    return translate_config(read_hf_config(path))
