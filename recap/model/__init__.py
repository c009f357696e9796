"""Model execution: HF config translation, strict loading, layers, model families, caches."""

from recap.model.cache import KVCache, ModelCaches, StateCache
from recap.model.config import ModelConfig, UnsupportedArchitectureError, load_config, translate_config
from recap.model.default_model import ensure_default_model
from recap.model.loader import LoadedModel, WeightLoadError, load_model, load_tokenizer
from recap.model.models import CausalLM

__all__ = [
    "CausalLM",
    "KVCache",
    "LoadedModel",
    "ModelCaches",
    "ModelConfig",
    "StateCache",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "ensure_default_model",
    "load_config",
    "load_model",
    "load_tokenizer",
    "translate_config",
]
