"""Shared test setup: one torch thread (2 threads on 2 shared cores ran 5-20x slower), seeded hypothesis."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("recap", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("recap")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# Without a GPU the Triton kernels (recap/kernels/triton/) run under Triton's interpreter on CPU tensors. Triton
# reads this when a kernel is decorated, so it is set before any test module imports them.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the core tests run without torch
    pass


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> folder of its tiny random checkpoint (recap.model.testing's TINY_ARCHS), built on first use."""
    from recap.model.testing import make_tiny_checkpoint  # torch: only for the tests that ask for a checkpoint

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` runs the files sharing a process cluster on one worker, long files first
    (tests/xdist_schedule.py); other modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_schedule import SharedFixtureFileScheduling

    return SharedFixtureFileScheduling(config, log)  # type: ignore[arg-type]
