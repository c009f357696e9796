"""Tiny checkpoints with a tokenizer for the cluster tests (a hybrid and an SSM-only model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cluster-tiny")
    return {a: tiny_model_dir(root, a) for a in ("bamba", "mamba2")}
