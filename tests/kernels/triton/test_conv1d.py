"""The Triton causal conv1d (recap/kernels/triton/conv1d.py) against the torch references.

Random packed steps from fresh seeds: odd lengths, lengths straddling the 16-token output tile and the
chunk grid, checkpoints inside chunks (windows reaching back into the initial state), padding rows, rows
without initial state, decode batches; outputs, written windows and slot_positions compared, every other
slot bit for bit unchanged.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from recap.kernels.triton.conv1d import causal_conv1d, causal_conv1d_update

from ..cases import Row, assert_close, build_meta, random_rows
from .device_rows import DEVICE, TOL, assert_untouched, packed, written_slots

SLOTS = 20
SEEDS = [101, 202, 303]


def _rows_case(d: int) -> SimpleNamespace:
    return SimpleNamespace(token_inputs=lambda n, g: {"x": torch.randn(n, d, generator=g)})


def _check_step(rows: list[Row], chunk: int, d: int, k: int, gen: torch.Generator, activation: str | None,
                with_bias: bool = True) -> None:  # fmt: skip
    """Run one packed step through the Triton kernel and the reference; compare everything they write."""
    x, w = packed(rows, "x"), torch.randn(d, k, generator=gen)
    bias = torch.randn(d, generator=gen) if with_bias else None
    before = torch.randn(SLOTS, d, k - 1, generator=gen)
    sp_before = torch.randint(0, 1000, (SLOTS,), generator=gen)
    cache, sp = before.clone(), sp_before.clone()
    meta = build_meta(rows, chunk)
    y_ref = causal_conv1d_ref(x, w, bias, cache, meta, activation, sp)
    tcache, tsp = before.clone(), sp_before.clone()
    y = causal_conv1d(x, w, bias, tcache, meta, activation, tsp)
    assert_close(y, y_ref, TOL)
    assert torch.equal(tcache, cache)  # windows are copies of inputs: exact
    assert torch.equal(tsp, sp)
    assert_untouched(before, tcache, written_slots(meta) if k > 1 else set())


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
@pytest.mark.parametrize("k", [4, 2])
def test_varlen_matches_reference(seed: int, k: int) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    d = rng.choice([6, 19])
    rows = random_rows(_rows_case(d), rng, gen, SLOTS, max_len=40)
    _check_step(rows, rng.choice([4, 8, 16]), d, k, gen, rng.choice([None, "silu"]), with_bias=rng.random() < 0.7)


def test_windows_reach_into_initial_state() -> None:
    """One-token and two-token rows with checkpoints after each token: windows mostly from the slot."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    x = _rows_case(5).token_inputs
    rows = [Row(x(1, gen), 9, 1, [(10, 2)]), Row(x(2, gen), 4, 3, [(5, 4), (6, 5)]), Row(x(3, gen), 0, 6, [(1, 7)])]
    _check_step(rows, 16, 5, 4, gen, "silu")


def test_wide_channels_and_long_row() -> None:
    """Channels over two 128-wide tiles, a row over many 16-token tiles and chunks, a padding row."""
    gen = torch.Generator(DEVICE).manual_seed(11)
    x = _rows_case(131).token_inputs
    rows = [Row(x(70, gen), 5, 0, [(16, 1), (47, 2)]), Row(x(9, gen), 0, PAD_SLOT_ID, padding=True)]
    _check_step(rows, 32, 131, 4, gen, None)


def test_kernel_size_one_writes_no_state() -> None:
    gen = torch.Generator(DEVICE).manual_seed(3)
    rows = [Row(_rows_case(4).token_inputs(5, gen), 2, 1, [(4, 2)])]
    _check_step(rows, 8, 4, 1, gen, "silu")


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_decode_batch_through_varlen(seed: int) -> None:
    """One token per row (the path the torch kernel takes for decode too): checkpoints, pads, fresh rows."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    x = _rows_case(7).token_inputs
    slots = rng.sample(range(SLOTS), 10)
    rows = []
    for r in range(5):
        if rng.random() < 0.25:
            rows.append(Row(x(1, gen), 0, PAD_SLOT_ID, padding=True))
            continue
        ctx = rng.choice([0, rng.randint(1, 40)])
        rows.append(Row(x(1, gen), ctx, slots[2 * r], [(ctx + 1, slots[2 * r + 1])] if rng.random() < 0.5 else []))
    _check_step(rows, 16, 7, 4, gen, "silu")


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
@pytest.mark.parametrize("with_init", [True, False])
def test_update_matches_reference(seed: int, with_init: bool) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    b, d, k = rng.randint(1, 9), rng.choice([5, 40]), rng.choice([2, 4])
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in rng.sample(range(SLOTS), b)]
    idx = torch.tensor(slots)
    init = torch.tensor([rng.random() > 0.3 for _ in slots]) if with_init else None
    x, w, bias = (torch.randn(*shape, generator=gen) for shape in ((b, d), (d, k), (d,)))
    before = torch.randn(SLOTS, d, k - 1, generator=gen)
    cache = before.clone()
    y_ref = causal_conv1d_update_ref(x, cache, w, bias, idx, "silu", init)
    tcache = before.clone()
    y = causal_conv1d_update(x, tcache, w, bias, idx, "silu", init)
    assert_close(y, y_ref, TOL)
    assert torch.equal(tcache, cache)
    assert_untouched(before, tcache, {s for s in slots if s != PAD_SLOT_ID})


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 kernels are checked on a GPU")
def test_bf16_on_gpu() -> None:
    gen = torch.Generator(DEVICE).manual_seed(5)
    d, k = 64, 4
    inputs = _rows_case(d).token_inputs
    rows = [Row(inputs(37, gen), 3, 0, [(20, 1)]), Row(inputs(5, gen), 0, 2)]
    x, w, bias = packed(rows, "x").bfloat16(), torch.randn(d, k, generator=gen).bfloat16(), None
    cache = torch.randn(4, d, k - 1, generator=gen).bfloat16()
    tcache = cache.clone()
    y_ref = causal_conv1d_ref(x, w, bias, cache, build_meta(rows, 16))
    y = causal_conv1d(x, w, bias, tcache, build_meta(rows, 16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(tcache, cache)
