"""Tiny random models, loaded once per test session (their checkpoints: tests/conftest.py's tiny_checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from recap.backends import prepare
from recap.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], LoadedModel]:
    """arch -> the recap model loaded from its tiny checkpoint (fp32, loaded once), prepared for the backend its
    default flags ask for, as a runner would run it."""
    loaded: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in loaded:
            loaded[arch] = load_model(tiny_checkpoint(arch))
            prepare(loaded[arch])
        return loaded[arch]

    return get
