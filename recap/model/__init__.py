"""Model execution: HF config translation, strict loading, layers, model families, caches."""

from recap.model.cache import KVCache, ModelCaches, StateCache
from recap.model.config import ModelConfig, UnsupportedArchitectureError, load_config, translate_config
from recap.model.default_model import ensure_random_model
from recap.model.loader import LoadedModel, WeightLoadError, load_model, load_tokenizer
from recap.model.models import CausalLM
from recap.model.trained_default import default_model_path, draft_model_path

__all__ = [
    "CausalLM",
    "KVCache",
    "LoadedModel",
    "ModelCaches",
    "ModelConfig",
    "StateCache",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "ensure_random_model",
    "load_config",
    "load_model",
    "load_tokenizer",
    "translate_config",
    "default_model_path",
    "draft_model_path",
]
