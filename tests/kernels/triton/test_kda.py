"""Triton KDA (the gated delta rule with a decay per key channel, q and k normalised in the kernel) against
the torch references: packed varlen steps (checkpoints inside pieces, pad rows, rows from scratch, decode
batches), strong decays over long rows, and the in-place decode update."""

from __future__ import annotations

import random

import pytest
import torch

from ..cases import Row, random_rows
from .delta_cases import check_step, check_update, fixed_rows, kda_delta
from .device_rows import DEVICE

SLOTS = 16


SHAPES = [(2, 16, 24), (1, 8, 5), (2, 32, 16)]  # (H, K, V): dims padded to 16


@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_rows_match_reference(shape: tuple[int, ...]) -> None:
    delta = kda_delta(*shape)
    gen = torch.Generator(DEVICE).manual_seed(shape[2])
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_match_reference(seed: int) -> None:
    """1-4 rows of 1-60 tokens from random contexts, up to 3 checkpoints each, pad rows, chunk grid 16 or 64."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = kda_delta(*SHAPES[seed % len(SHAPES)])
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=60), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.parametrize("seed", range(2))
def test_decode_batch_matches_reference(seed: int) -> None:
    rng, gen = random.Random(200 + seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = kda_delta(2, 16, 24)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=1), 16, SLOTS, gen)


def test_strong_decay_stays_finite() -> None:
    """Per-channel log decays down to -60 a token: exp(cum) underflows to 0 in every piece, never overflows."""
    gen = torch.Generator(DEVICE).manual_seed(9)
    delta = kda_delta(1, 16, 16, decay=60.0)
    rows = [Row(delta.token_inputs(70, gen), 3, 0, [(20, 1), (50, 2)])]
    check_step(delta, rows, 64, 4, gen)


@pytest.mark.parametrize("seed", range(4))
def test_update_matches_reference(seed: int) -> None:
    check_update(kda_delta(*SHAPES[seed % len(SHAPES)]), seed, SLOTS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (garbage under the interpreter)")
def test_bf16_inputs_match_reference() -> None:
    delta = kda_delta(2, 64, 64)
    gen = torch.Generator(DEVICE).manual_seed(1)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, torch.bfloat16, 3e-2)
