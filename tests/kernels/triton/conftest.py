"""The Triton kernel tests run on the GPU where there is one (compiled), else on the CPU under the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1): tensors the tests make go to that device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _kernel_device() -> Iterator[None]:
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(previous)
