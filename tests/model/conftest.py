"""Tiny random models, loaded once per test session (their checkpoints: tests/conftest.py's tiny_checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from recap.backends import Backend, prepare
from recap.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_prepared(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], tuple[LoadedModel, Backend]]:
    """arch -> (the recap model loaded from its tiny checkpoint (fp32, loaded once), the backend its default flags
    ask for, which prepared it): tests step it through that backend, as a runner does."""
    loaded: dict[str, tuple[LoadedModel, Backend]] = {}

    def get(arch: str) -> tuple[LoadedModel, Backend]:
        if arch not in loaded:
            lm = load_model(tiny_checkpoint(arch))
            loaded[arch] = (lm, prepare(lm))
        return loaded[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_prepared: Callable[[str], tuple[LoadedModel, Backend]]) -> Callable[[str], LoadedModel]:
    """arch -> tiny_prepared's loaded model."""
    return lambda arch: tiny_prepared(arch)[0]


@pytest.fixture(scope="session")
def tiny_backend(tiny_prepared: Callable[[str], tuple[LoadedModel, Backend]]) -> Callable[[str], Backend]:
    """arch -> the backend that prepared tiny_model(arch)."""
    return lambda arch: tiny_prepared(arch)[1]
