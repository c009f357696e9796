"""What a checkpoint folder says about serving it, as vLLM reads it: the context length from
config.json and default sampling settings from generation_config.json.

`generation_config`: "auto" reads the model folder's generation_config.json, "vllm" (vLLM's name)
uses none, anything else is a folder holding one. Only the sampling fields vLLM takes from it are
read; a request's own value always wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
GENERATION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
# config.json keys that bound the context, in the order they are looked for
_LENGTH_KEYS = ("max_position_embeddings", "max_seq_len", "max_sequence_length", "seq_length", "n_positions")
FALLBACK_MAX_MODEL_LEN = 4096  # a model whose config states no length (pure Mamba checkpoints)


def model_folder(model: str | None) -> Path:
    """The local folder of `model` (None: the embedded default model, built on first use)."""
    if model is None:
        from recap.model.default_model import ensure_default_model

        return ensure_default_model()
    from recap.model.loader import resolve_model_path

    return resolve_model_path(model)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def derived_max_model_len(folder: Path) -> int:
    """The context length config.json states (text_config first for multimodal wrappers)."""
    path = folder / "config.json"
    cfg = _read_json(path) if path.is_file() else {}
    for section in (cfg.get("text_config") or {}, cfg):
        for key in _LENGTH_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return FALLBACK_MAX_MODEL_LEN


def generation_defaults(model_folder: Path, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams fields -> default values (empty under "vllm" or without a file)."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else Path(generation_config).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {folder}")
        return {}
    data = _read_json(path)
    return {field: data[key] for key, field in GENERATION_FIELDS.items() if data.get(key) is not None}
