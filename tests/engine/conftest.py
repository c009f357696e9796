"""Tiny checkpoints with a tokenizer, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap.model.testing import make_tiny_checkpoint
from tests.tiny_tokenizer import save_tiny_tokenizer

ARCHS = ["mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "nemotron_h", "granite_hybrid", "falcon_h1", "zamba2",
         "zamba", "minimax", "qwen3_5", "lfm3", "kimi_linear", "glm5_next", "recurrent_gemma",
         "bailing_hybrid", "qwen4_exp", "inkling", "inkling2", "rwkv", "xlstm", "zaya"]


def tiny_model_dir(root: Path, arch: str, **overrides: object) -> Path:
    path = make_tiny_checkpoint(arch, root / arch, **overrides)
    save_tiny_tokenizer(path, vocab_size=512)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: tiny_model_dir(root, a) for a in ARCHS}
