"""What a checkpoint says about serving it, as vLLM reads it: the context length from its config
(max_position_embeddings) and default sampling settings from generation_config.json.

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
FALLBACK_MAX_MODEL_LEN = 4096  # a model whose config states no length (pure Mamba checkpoints)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def derived_max_model_len(max_position_embeddings: int | None) -> int:
    """vLLM's default context: what the model's config states (FALLBACK_MAX_MODEL_LEN when it states none)."""
    return max_position_embeddings if max_position_embeddings else FALLBACK_MAX_MODEL_LEN


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
