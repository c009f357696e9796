"""Shared test setup: one torch thread (2 threads on 2 shared cores ran 5-20x slower), seeded hypothesis."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("recap", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("recap")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the core tests run without torch
    pass
