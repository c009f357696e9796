"""Triton gated delta rule (GDN: a decay per head) against the torch references: packed varlen steps (per token
and chunked pieces, GQA, checkpoints inside pieces, pad rows, rows from scratch, decode batches with
checkpoints) and the in-place decode update."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.gdn import gated_delta_rule_ref, gdn_gates, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update_ref
from recap.kernels.triton.gdn import gated_delta_rule_update, gated_delta_rule_varlen

from ..cases import Tensors, random_rows
from .delta_cases import Delta, check_step, check_update, cuda_step, fixed_rows

SLOTS = 16


def gdn_delta(hk: int, hv: int, dk: int, dv: int, piece: int = 16) -> Delta:
    """GDN as its layer calls it: q, k L2-normalised (q scaled), g = the log decay per value head."""

    def token_inputs(n: int, gen: torch.Generator) -> Tensors:
        g, beta = gdn_gates(torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen),
                            torch.rand(hv, generator=gen) * 2 - 1, torch.randn(hv, generator=gen))  # fmt: skip
        q = l2_normalize(torch.randn(n, hk, dk, generator=gen)) * dk**-0.5
        k = l2_normalize(torch.randn(n, hk, dk, generator=gen))
        return {"q": q, "k": k, "v": torch.randn(n, hv, dv, generator=gen), "g": g, "beta": beta}

    def args(x: Tensors) -> tuple[torch.Tensor, ...]:
        return x["q"], x["k"], x["v"], x["g"], x["beta"]

    return Delta(
        token_inputs=token_inputs,
        cache_shape=(hv, dk, dv),
        varlen=lambda x, cache, meta, sp: gated_delta_rule_varlen(*args(x), cache, meta, sp, piece=piece),
        varlen_ref=lambda x, cache, meta, sp: gated_delta_rule_ref(*args(x), cache, meta, sp),
        update=lambda x, cache, *rest: gated_delta_rule_update(cache, *args(x), *rest),
        update_ref=lambda x, cache, *rest: gated_delta_rule_update_ref(cache, *args(x), *rest),
    )


SHAPES = [(2, 2, 16, 24), (1, 2, 8, 5), (1, 3, 32, 16)]  # (Hk, Hv, Dk, Dv): GQA, dims padded to 16


@pytest.mark.parametrize("piece", [1, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_rows_match_reference(shape: tuple[int, ...], piece: int) -> None:
    delta = gdn_delta(*shape, piece=piece)
    gen = torch.Generator().manual_seed(piece + shape[3])
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("piece", [1, 16])
def test_random_steps_match_reference(seed: int, piece: int) -> None:
    """1-4 rows of 1-60 tokens from random contexts, up to 3 checkpoints each, pad rows, chunk grid 16 or 64."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    delta = gdn_delta(*SHAPES[seed % len(SHAPES)], piece=piece)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=60), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.parametrize("seed", range(3))
def test_decode_batch_matches_reference(seed: int) -> None:
    """One token per row (the per-token path), checkpoints at the token, pad rows, rows from scratch."""
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(seed)
    delta = gdn_delta(1, 2, 16, 24)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=1), 16, SLOTS, gen)


@pytest.mark.parametrize("seed", range(4))
def test_update_matches_reference(seed: int) -> None:
    check_update(gdn_delta(*SHAPES[seed % len(SHAPES)]), seed, SLOTS)


def test_update_needs_positions_with_slot_positions() -> None:
    delta = gdn_delta(1, 1, 16, 16)
    x = delta.token_inputs(1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="positions"):
        delta.update(x, torch.zeros(2, 1, 16, 16), torch.tensor([0]), torch.zeros(2, dtype=torch.int64), None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_step_matches_reference(dtype: torch.dtype, tol: float) -> None:
    cuda_step(gdn_delta(2, 4, 64, 64), dtype, tol)
