"""Tiny random checkpoints, built once per test session (transformers' own classes, saved to disk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from recap.model.loader import LoadedModel, load_model
from recap.model.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> folder of its tiny checkpoint (built on first use)."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], LoadedModel]:
    """arch -> the recap model loaded from its tiny checkpoint (fp32, loaded once)."""
    loaded: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in loaded:
            loaded[arch] = load_model(tiny_checkpoint(arch))
        return loaded[arch]

    return get
