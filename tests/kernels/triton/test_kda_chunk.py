"""The chunk-parallel Triton KDA (triton/gdn_chunk.py with a decay per key channel) against the torch reference
(recap/kernels/kda.py): outputs, every slot written (checkpoints inside pieces and at piece ends, running
slots), slot_positions, slots not written bit for bit, pad rows' zero outputs, on packed varlen steps (odd
lengths straddling the piece and block grids, several rows, rows from scratch, strong decays, strided inputs),
kda's choice of the chunk form for long steps, and (-m slow) the kernels' compilation for sm_90."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import recap.kernels.triton.gdn as triton_gdn
from recap.core.output import PAD_SLOT_ID
from recap.kernels.triton.gdn import CHUNK_MIN_TOKENS

from ..cases import Row, Tensors, random_rows
from .delta_cases import DEVICE, check_step, fixed_rows, fused_views, kda_delta
from .hopper import compile_for_hopper

SLOTS = 16
SHAPES = [(2, 16, 24), (1, 8, 5), (2, 32, 16)]  # (H, K, V): dims padded to 16
WIDE_V = (1, 16, 72)  # Dv over several tiles: 3 of the state walk's 32, 2 of the outputs' and W/U's 64


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("shape", [*SHAPES, WIDE_V])
def test_fixed_rows_match_reference(shape: tuple[int, ...], chunk: int) -> None:
    """Rows straddling the 32-token block grid, checkpoints inside pieces, a pad row, a one-token row."""
    delta = kda_delta(*shape, chunk=chunk)
    gen = torch.Generator(DEVICE).manual_seed(1000 + chunk + shape[2])
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_reference(seed: int) -> None:
    """1-4 rows of 1-70 tokens from random contexts, up to 3 checkpoints each, pad rows, block grid 16 or 64,
    pieces of 16 or 32 tokens."""
    rng, gen = random.Random(7100 + seed), torch.Generator(DEVICE).manual_seed(7100 + seed)
    delta = kda_delta(*SHAPES[seed % len(SHAPES)], chunk=rng.choice([16, 32]))
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=70), rng.choice([16, 64]), SLOTS, gen)


def test_checkpoints_at_piece_ends_and_one_past_match_reference() -> None:
    """Checkpoints exactly at 16-token piece ends, one token before and after one, at the first token and at
    the row end (also the running state), rows longer than a block; a pad row between them."""
    delta = kda_delta(2, 16, 24, chunk=16)
    gen = torch.Generator(DEVICE).manual_seed(77)
    x = delta.token_inputs
    rows = [
        Row(x(50, gen), 0, 0, [(1, 4), (16, 5), (31, 6), (33, 7), (50, 8)]),
        Row(x(9, gen), 0, PAD_SLOT_ID, padding=True),
        Row(x(41, gen), 16, 1, [(32, 9), (48, 10), (57, 11)]),
        Row(x(17, gen), 5, 2, [(21, 12)]),
    ]
    check_step(delta, rows, 32, SLOTS, gen)


@pytest.mark.parametrize("chunk", [16, 32])
def test_strong_decay_matches_reference(chunk: int) -> None:
    """Per-channel log decays down to -60 a token (cum near -1e3 inside a piece): every exponent stays <= 0,
    so terms underflow to 0 instead of overflowing, and outputs and states are still the reference's."""
    delta = kda_delta(2, 16, 24, decay=60.0, chunk=chunk)
    gen = torch.Generator(DEVICE).manual_seed(90 + chunk)
    rows = [*fixed_rows(delta, gen), Row(delta.token_inputs(45, gen), 3, 8, [(20, 9), (40, 10)])]
    check_step(delta, rows, 32, SLOTS, gen)


def test_mixed_decay_channels_match_reference() -> None:
    """Half the channels decay hard (-30 a token), half barely (-1e-3): the per-channel factors differ by
    many orders of magnitude inside one piece."""
    delta = kda_delta(1, 16, 16, chunk=32)
    gen = torch.Generator(DEVICE).manual_seed(91)

    def mixed(x: Tensors) -> Tensors:
        scale = torch.where(torch.arange(16) % 2 == 0, 15.0, 5e-4)
        return {**x, "g": x["g"] * scale}

    rows = [Row(delta.token_inputs(61, gen), 2, 0, [(30, 1), (45, 2)]), Row(delta.token_inputs(7, gen), 0, 3)]
    check_step(delta, rows, 64, SLOTS, gen, layout=mixed)


def test_strided_inputs_match_reference() -> None:
    """q, k, v views of one fused projection row; g with its channel axis strided (made contiguous)."""
    delta = kda_delta(2, 16, 24, chunk=16)
    gen = torch.Generator(DEVICE).manual_seed(92)

    def strided(x: Tensors) -> Tensors:
        views = fused_views({**x, "g": x["beta"]})  # q, k, v (and beta) as views; g laid out below
        return {**views, "g": x["g"].transpose(1, 2).contiguous().transpose(1, 2)}

    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen, layout=strided)


def test_decode_batch_in_the_chunk_form_matches_reference() -> None:
    """One-token pieces: checkpoints at the token, pad rows, rows from scratch."""
    rng, gen = random.Random(7400), torch.Generator(DEVICE).manual_seed(7400)
    delta = kda_delta(2, 16, 24, chunk=16)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=1), 16, SLOTS, gen)


def test_long_steps_take_the_chunk_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of CHUNK_MIN_TOKENS tokens or more, through kda itself (64-token pieces), never reaches the piece
    kernel and matches the reference: rows straddling the 64 grid, checkpoints inside pieces and at their ends."""

    def piece_kernel(*_: object) -> torch.Tensor:
        raise AssertionError("the piece kernel ran a long prefill step")

    monkeypatch.setattr(triton_gdn, "run_varlen", piece_kernel)
    gen = torch.Generator(DEVICE).manual_seed(93)
    delta = kda_delta(1, 16, 16, decay=4.0)
    x, n = delta.token_inputs, CHUNK_MIN_TOKENS // 2 + 7
    rows = [Row(x(n, gen), 3, 0, [(40, 4), (67, 5), (131, 6)]), Row(x(3, gen), 0, PAD_SLOT_ID, padding=True),
            Row(x(n - 9, gen), 0, 1, [(64, 7)])]  # fmt: skip
    check_step(delta, rows, 64, SLOTS, gen)


def test_short_steps_keep_the_piece_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CHUNK_MIN_TOKENS tokens kda stays on the per-row walk (the chunk form is never launched)."""

    def chunk_form(*_: object, **__: object) -> torch.Tensor:
        raise AssertionError("the chunk form ran a short step")

    monkeypatch.setattr(triton_gdn, "chunk_gated_delta_rule", chunk_form)
    delta = kda_delta(1, 16, 16)
    gen = torch.Generator(DEVICE).manual_seed(94)
    check_step(delta, fixed_rows(delta, gen), 32, SLOTS, gen)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_larger_random_steps_match_reference(seed: int) -> None:
    """A larger study: 64-token pieces (the shipped size) at K, V 64 / 40, 1-4 rows of up to 200 tokens from
    random contexts, up to 3 checkpoints each, pad rows, decays up to -8 a token."""
    rng, gen = random.Random(7500 + seed), torch.Generator(DEVICE).manual_seed(7500 + seed)
    delta = kda_delta(2, 64, 40, decay=rng.choice([0.5, 8.0]), chunk=64)
    check_step(delta, random_rows(delta, rng, gen, SLOTS, max_len=200), rng.choice([16, 64]), SLOTS, gen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (garbage under the interpreter)")
def test_bf16_inputs_match_reference() -> None:
    """bf16 q/k/v (W, U, V' and the piece-start states stored in bf16) at the GPU's tolerance, 64-token pieces."""
    delta = kda_delta(2, 64, 64, chunk=64)
    gen = torch.Generator(DEVICE).manual_seed(95)
    x = delta.token_inputs
    rows = [*fixed_rows(delta, gen), Row(x(150, gen), 7, 8, [(70, 9), (100, 10)])]
    check_step(delta, rows, 64, SLOTS, gen, torch.bfloat16, 3e-2)


def compile_delta_kernels() -> None:
    """Compile the chunk form's three kernels (KDA's per-channel decay and GDN's per-head one) and the per-row
    walk's kernel with KDA's decay, bf16 at Kimi-Linear's dims (128) and the shipped tiles, for sm_90. Needs
    triton imported with TRITON_INTERPRET=0."""
    from recap.kernels.triton import gdn, gdn_chunk

    idx = ("tok0", "len", "ends", "p0", "np", "valid", "run", "last", "dest", "pos", "cu")
    ptrs = {f"{n}_ptr": "*i64" for n in idx} | {"init_ptr": "*i1", "sp_ptr": "*i64", "state_ptr": "*fp32"}
    ptrs |= {f"{n}_ptr": "*bf16" for n in ("q", "k", "v", "w", "u", "h", "o")}
    ptrs |= {"g_ptr": "*fp32", "b_ptr": "*fp32", "cum_ptr": "*fp32"}
    base = {"BK": 128, "NORM_QK": True, "PREC": "tf32"}
    for per_channel in (True, False):
        kw = {**base, "BT": gdn_chunk.CHUNK, "PER_CHANNEL": per_channel}
        compile_for_hopper(gdn_chunk._wy_kernel, ptrs, {**kw, "BV": gdn_chunk.BLOCK_V_OUT})
        compile_for_hopper(gdn_chunk._state_kernel, ptrs, {**kw, "BV": gdn_chunk.BLOCK_V, "HAS_SP": True})
        compile_for_hopper(gdn_chunk._output_kernel, ptrs, {**kw, "BV": gdn_chunk.BLOCK_V_OUT}, floats=("q_scale",))
    walk = {**base, "BT": gdn.PIECE, "BV": gdn.BLOCK_V, "PER_CHANNEL": True, "HAS_SP": True}
    compile_for_hopper(gdn._gated_delta_kernel, ptrs, walk, floats=("q_scale",))


@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    """What only the compiler refuses (the interpreter runs any Python) fails here, without a GPU: the kernels
    compile for sm_90 through ptxas, in a fresh process with the interpreter off (~60 s on the 2-core box)."""
    code = "from tests.kernels.triton.test_kda_chunk import compile_delta_kernels\ncompile_delta_kernels()"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
