"""The chunk-parallel Triton gated delta rule (triton/gdn_chunk.py) against the torch reference: outputs, every
slot written (checkpoints inside chunks, running slots), slot_positions, slots not written bit for bit, on packed
varlen steps (odd lengths straddling the chunk and block grids, several rows, pad rows, initial states, GQA,
raw q/k normalised in the kernel, strided inputs), and the op's choice of form by token count."""

from __future__ import annotations

import random

import pytest
import torch

import recap.kernels.triton.gdn as triton_gdn
from recap.kernels.triton.gdn import CHUNK_MIN_TOKENS, gated_delta_rule

from ..cases import Row, build_meta, random_rows
from .delta_cases import DEVICE, check_step, fixed_rows, fused_views, gdn_delta

SLOTS = 16
SHAPES = [(2, 2, 16, 24), (1, 2, 8, 5), (1, 3, 32, 16)]  # (Hk, Hv, Dk, Dv): GQA, dims padded to 16
WIDE_V = (1, 2, 16, 72)  # Dv over several tiles: 3 of the state walk's 32, 2 of the outputs' and W/U's 64


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("shape", [*SHAPES, WIDE_V])
def test_fixed_rows_match_reference(shape: tuple[int, ...], chunk: int) -> None:
    """Rows straddling the 32-token block grid, checkpoints inside chunks, a pad row, a one-token row."""
    delta = gdn_delta(*shape, chunk=chunk)
    gen = torch.Generator(DEVICE).manual_seed(chunk + shape[3])
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_reference(seed: int) -> None:
    """1-4 rows of 1-70 tokens from random contexts, up to 3 checkpoints each, pad rows, block grid 16 or 64,
    chunks of 16 or 32 tokens."""
    rng, gen = random.Random(200 + seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = gdn_delta(*SHAPES[seed % len(SHAPES)], chunk=rng.choice([16, 32]))
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=70), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.parametrize("seed", range(2))
def test_q_k_normalised_in_the_kernel_match_reference(seed: int) -> None:
    rng, gen = random.Random(300 + seed), torch.Generator(DEVICE).manual_seed(seed)
    delta = gdn_delta(*SHAPES[seed], normalize_qk=True, chunk=16)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=50), rng.choice([16, 64]), SLOTS, gen)


def test_strided_inputs_match_reference() -> None:
    delta = gdn_delta(1, 2, 16, 24, chunk=16)
    gen = torch.Generator(DEVICE).manual_seed(3)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, layout=fused_views)


def test_strong_decay_matches_reference() -> None:
    """Log decays ~40x the usual (cum down to ~-1e3 inside a chunk): every exponent stays <= 0, so the terms
    underflow to 0 instead of overflowing, and the outputs and states are still the reference's."""
    delta = gdn_delta(1, 2, 16, 24, chunk=32)
    gen = torch.Generator(DEVICE).manual_seed(9)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, layout=lambda x: {**x, "g": x["g"] * 40})


def test_decode_batch_in_the_chunk_form_matches_reference() -> None:
    """One-token pieces: checkpoints at the token, pad rows, rows from scratch."""
    rng, gen = random.Random(400), torch.Generator(DEVICE).manual_seed(4)
    delta = gdn_delta(1, 2, 16, 24, chunk=16)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=1), 16, SLOTS, gen)


def test_long_steps_take_the_chunk_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of CHUNK_MIN_TOKENS tokens or more, through the op's defaults (64-token chunks), never reaches the
    piece kernel and matches the reference: rows straddling the 64 grid, checkpoints inside chunks."""

    def piece_kernel(*_: object) -> torch.Tensor:
        raise AssertionError("the piece kernel ran a long prefill step")

    monkeypatch.setattr(triton_gdn, "run_varlen", piece_kernel)
    gen = torch.Generator(DEVICE).manual_seed(5)
    delta = gdn_delta(1, 2, 16, 16, normalize_qk=True)
    x, n = delta.token_inputs, CHUNK_MIN_TOKENS // 2 + 7
    rows = [Row(x(n, gen), 3, 0, [(40, 4), (100, 5), (131, 6)]), Row(x(3, gen), 0, -1, padding=True),
            Row(x(n - 9, gen), 0, 1, [(64, 7)])]  # fmt: skip
    check_step(delta, rows, 64, SLOTS, gen)


def test_decay_of_another_shape_is_refused() -> None:
    """g is one decay per head [T, Hv] (GDN) or per key channel [T, Hv, Dk] (KDA); any other shape is a typed
    error, not a wrong answer."""
    delta = gdn_delta(1, 1, 16, 16, chunk=16)
    gen = torch.Generator(DEVICE).manual_seed(6)
    row = Row(delta.token_inputs(4, gen), 0, 0)
    meta = build_meta([row], 16)
    x = row.inputs
    g = x["g"][..., None].expand(-1, -1, 8)  # 8 channels for Dk 16
    with pytest.raises(ValueError, match=r"g must be \[T, Hv\] or \[T, Hv, Dk\]"):
        gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], torch.zeros(1, 1, 16, 16), meta, chunk=16)


def test_chunk_not_a_power_of_two_is_refused() -> None:
    delta = gdn_delta(1, 1, 16, 16, chunk=24)
    gen = torch.Generator(DEVICE).manual_seed(7)
    with pytest.raises(ValueError, match="power of two"):
        check_step(delta, [Row(delta.token_inputs(4, gen), 0, 0)], 16, SLOTS, gen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (garbage under the interpreter)")
def test_bf16_inputs_match_reference() -> None:
    """bf16 q/k/v (W, U, V' and the piece-start states stored in bf16, as fla does) at the GPU's tolerance."""
    delta = gdn_delta(2, 4, 64, 64, chunk=64)
    gen = torch.Generator(DEVICE).manual_seed(8)
    x = delta.token_inputs
    rows = [*fixed_rows(delta, gen), Row(x(150, gen), 7, 8, [(70, 9), (100, 10)])]
    check_step(delta, rows, 64, SLOTS, gen, torch.bfloat16, 3e-2)
