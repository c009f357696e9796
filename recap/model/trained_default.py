"""The served default: a small NemotronH hybrid trained on public-domain English, shipped as package data.

`recap serve` / `LLM()` / `recap generate` without a model start on `default_model_path()`; its draft
(`draft_model_path()`, same tokenizer) is for speculative decoding. Both live in recap/model/weights/, written
by tools/ship_default_model.py from a run of tools/train_default_model.py (docs/default_model.md). The
random-weight hybrid that tests and the benchmark shapes use is recap/model/default_model.py
(`ensure_random_model`).
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


class DefaultModelMissingError(FileNotFoundError):
    """The package data folder of a trained default model is incomplete (a checkout without its weights)."""


def _checked(folder: Path) -> Path:
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise DefaultModelMissingError(
            f"the trained default model at {folder} lacks {', '.join(missing)}: reinstall recap, or rebuild "
            "it with tools/ship_default_model.py (docs/default_model.md)")
    return folder


def default_model_path() -> Path:
    """The trained default model's folder (config, bf16 safetensors, tokenizer, generation config)."""
    return _checked(WEIGHTS_DIR / "default")


def draft_model_path() -> Path:
    """The trained draft model's folder: same tokenizer as the default, for speculative decoding."""
    return _checked(WEIGHTS_DIR / "default-draft")
