"""Model families by HF architecture name: `MODEL_CLASSES`, a view of the family registry (model/families.py)."""

from __future__ import annotations

from recap.model.families import FAMILIES
from recap.model.models.base import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {f.architecture: f.model_class() for f in FAMILIES}

__all__ = ["MODEL_CLASSES", "CausalLM"]
