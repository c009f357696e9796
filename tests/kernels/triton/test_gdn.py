"""Triton gated delta rule (GDN: a decay per head) against the torch references: packed varlen steps (per token
and chunked pieces, GQA, checkpoints inside pieces, pad rows, rows from scratch, decode batches with
checkpoints) and the in-place decode update."""

from __future__ import annotations

import random

import pytest
import torch

from ..cases import random_rows
from .delta_cases import DEVICE, check_step, check_update, fixed_rows, fused_views, gdn_delta

SLOTS = 16


SHAPES = [(2, 2, 16, 24), (1, 2, 8, 5), (1, 3, 32, 16)]  # (Hk, Hv, Dk, Dv): GQA, dims padded to 16


@pytest.mark.parametrize("piece", [1, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_rows_match_reference(shape: tuple[int, ...], piece: int) -> None:
    delta = gdn_delta(*shape, piece=piece)
    gen = torch.Generator(DEVICE).manual_seed(piece + shape[3])
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("piece", [1, 16])
def test_random_steps_match_reference(seed: int, piece: int) -> None:
    """1-4 rows of 1-60 tokens from random contexts, up to 3 checkpoints each, pad rows, chunk grid 16 or 64."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = gdn_delta(*SHAPES[seed % len(SHAPES)], piece=piece)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=60), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.parametrize(("seed", "piece"), [(0, 1), (1, 16), (2, 16)])
def test_q_k_normalised_in_the_kernel_match_reference(seed: int, piece: int) -> None:
    """Raw q, k (normalize_qk, as the GDN layer calls the op): normalised as the kernel loads them, per token and
    per piece, equal to the reference normalising them first."""
    rng, gen = random.Random(50 + seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = gdn_delta(*SHAPES[seed % len(SHAPES)], piece=piece, normalize_qk=True)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=40), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.parametrize("seed", range(3))
def test_decode_batch_matches_reference(seed: int) -> None:
    """One token per row (the per-token path), checkpoints at the token, pad rows, rows from scratch."""
    rng, gen = random.Random(100 + seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = gdn_delta(1, 2, 16, 24)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=1), 16, SLOTS, gen)


@pytest.mark.parametrize("piece", [1, 16])
def test_strided_inputs_match_reference(piece: int) -> None:
    delta = gdn_delta(1, 2, 16, 24, piece=piece)
    gen = torch.Generator(DEVICE).manual_seed(3)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, layout=fused_views)


@pytest.mark.parametrize("seed", range(4))
def test_update_matches_reference(seed: int) -> None:
    check_update(gdn_delta(*SHAPES[seed % len(SHAPES)]), seed, SLOTS)


def test_update_needs_positions_with_slot_positions() -> None:
    delta = gdn_delta(1, 1, 16, 16)
    x = delta.token_inputs(1, torch.Generator(DEVICE).manual_seed(0))
    x = {k: v.to(DEVICE) for k, v in x.items()}
    cache, sp = torch.zeros(2, 1, 16, 16, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        delta.update(x, cache, torch.tensor([0], device=DEVICE), sp, None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (garbage under the interpreter)")
@pytest.mark.parametrize("piece", [1, 16])
def test_bf16_inputs_match_reference(piece: int) -> None:
    delta = gdn_delta(2, 4, 64, 64, piece=piece)
    gen = torch.Generator(DEVICE).manual_seed(piece)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, torch.bfloat16, 3e-2)
