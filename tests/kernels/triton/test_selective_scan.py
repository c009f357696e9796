"""The Triton Mamba1 selective scan (recap/kernels/triton/selective_scan.py) against the torch references.

Random packed steps: odd lengths, lengths straddling the unrolled token group and the chunk grid,
checkpoints inside chunks, padding rows, rows without initial state, channels over two tiles and a state
size that is not a power of two, every optional input present or absent, decode batches; outputs,
written states and slot_positions compared, every other slot bit for bit unchanged.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.selective_scan import selective_scan_ref, selective_state_update_ref
from recap.kernels.triton.selective_scan import selective_scan, selective_state_update

from ..cases import Row, assert_close, build_meta, random_rows
from .device_rows import DEVICE, TOL, assert_untouched, packed, written_slots

SLOTS = 20
SEEDS = [11, 22, 33]
I, N = 20, 5  # two 16-wide channel tiles; N padded to 8


def _token_inputs(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.randn(n, N if k in "BC" else I, generator=g) for k in ("u", "dt", "B", "C", "z")}


def _params(gen: torch.Generator, decay: float = 4.0) -> dict[str, torch.Tensor]:
    D, bias = torch.randn(2, I, generator=gen)
    return {"A": -torch.rand(I, N, generator=gen) * decay, "D": D, "bias": bias}


def _check_step(rows: list[Row], chunk: int, gen: torch.Generator, options: str = "all", block: int = 16,
                decay: float = 4.0) -> None:  # fmt: skip
    """One packed step through the Triton kernel and the reference; options 'bare' drops D, z and dt bias."""
    p = _params(gen, decay)
    bare = options == "bare"
    dt = packed(rows, "dt")
    args = [packed(rows, "u"), dt.abs() if bare else dt, p["A"], packed(rows, "B"), packed(rows, "C"),
            None if bare else p["D"], None if bare else packed(rows, "z"), None if bare else p["bias"]]  # fmt: skip
    before = torch.randn(SLOTS, I, N, generator=gen)
    sp_before = torch.randint(0, 1000, (SLOTS,), generator=gen)
    cache, sp = before.clone(), sp_before.clone()
    meta = build_meta(rows, chunk)
    y_ref = selective_scan_ref(*args, not bare, cache, meta, sp)
    tcache, tsp = before.clone(), sp_before.clone()
    y = selective_scan(*args, not bare, tcache, meta, tsp, block=block)
    assert_close(y, y_ref, TOL)
    assert_close(tcache, cache, TOL)
    assert torch.equal(tsp, sp)
    assert_untouched(before, tcache, written_slots(meta))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block", [16, 5])
def test_varlen_matches_reference(seed: int, block: int) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    rows = random_rows(SimpleNamespace(token_inputs=_token_inputs), rng, gen, SLOTS, max_len=36)
    _check_step(rows, rng.choice([4, 8, 16]), gen, block=block)


def test_bare_options_long_row_strong_decay() -> None:
    """No D, z or dt bias, no softplus; a row over many chunks and groups; decays of exp(-80 dt)."""
    gen = torch.Generator(DEVICE).manual_seed(4)
    rows = [Row(_token_inputs(75, gen), 6, 1, [(23, 2), (40, 3), (81, 4)]), Row(_token_inputs(3, gen), 0, 5)]
    _check_step(rows, 16, gen, options="bare", decay=80.0)


def test_checkpoint_after_first_token_and_padding_rows() -> None:
    gen = torch.Generator(DEVICE).manual_seed(8)
    rows = [
        Row(_token_inputs(4, gen), 0, PAD_SLOT_ID, padding=True),
        Row(_token_inputs(17, gen), 3, 0, [(4, 1)]),
        Row(_token_inputs(1, gen), 0, PAD_SLOT_ID, padding=True),
        Row(_token_inputs(2, gen), 0, 2, [(1, 3)]),
    ]
    _check_step(rows, 8, gen)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_batch_through_varlen(seed: int) -> None:
    """One token per row, with checkpoints, padding rows and fresh rows (the torch kernel's decode route)."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    slots = rng.sample(range(SLOTS), 12)
    rows = []
    for r in range(6):
        if rng.random() < 0.25:
            rows.append(Row(_token_inputs(1, gen), 0, PAD_SLOT_ID, padding=True))
            continue
        ctx = rng.choice([0, rng.randint(1, 40)])
        cps = [(ctx + 1, slots[2 * r + 1])] if rng.random() < 0.5 else []
        rows.append(Row(_token_inputs(1, gen), ctx, slots[2 * r], cps))
    _check_step(rows, 16, gen)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("options", ["all", "bare"])
def test_update_matches_reference(seed: int, options: str) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    b = rng.randint(1, 9)
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in rng.sample(range(SLOTS), b)]
    bare = options == "bare"
    inp, p = _token_inputs(b, gen), _params(gen)
    idx = torch.tensor(slots)
    init = None if bare else torch.tensor([rng.random() > 0.3 for _ in slots])
    pos = torch.randint(0, 100, (b,), generator=gen)
    before = torch.randn(SLOTS, I, N, generator=gen)
    sp_before = torch.randint(0, 1000, (SLOTS,), generator=gen)
    cache, sp = before.clone(), sp_before.clone()
    args = [inp["u"], inp["dt"].abs() if bare else inp["dt"], p["A"], inp["B"], inp["C"],
            None if bare else p["D"], None if bare else inp["z"], None if bare else p["bias"]]  # fmt: skip
    y_ref = selective_state_update_ref(cache, *args, not bare, idx, sp, pos, init)
    tcache, tsp = before.clone(), sp_before.clone()
    y = selective_state_update(tcache, *args, not bare, idx, tsp, pos, init)
    assert_close(y, y_ref, TOL)
    assert_close(tcache, cache, TOL)
    assert torch.equal(tsp, sp)
    assert_untouched(before, tcache, {s for s in slots if s != PAD_SLOT_ID})


def test_update_needs_positions_with_slot_positions() -> None:
    gen = torch.Generator(DEVICE).manual_seed(1)
    inp, p = _token_inputs(2, gen), _params(gen)
    args = (inp["u"], inp["dt"], p["A"], inp["B"], inp["C"], None, None, None, True, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="positions"):
        selective_state_update(torch.zeros(SLOTS, I, N), *args, torch.zeros(SLOTS, dtype=torch.int64), None)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 kernels are checked on a GPU")
def test_bf16_inputs_on_gpu() -> None:
    """bf16 activations, fp32 state: outputs within bf16 rounding, states close to the reference's."""
    gen = torch.Generator(DEVICE).manual_seed(9)
    rows = [Row(_token_inputs(45, gen), 2, 0, [(30, 1)]), Row(_token_inputs(7, gen), 0, 2)]
    p = _params(gen)
    keys = ("u", "dt", "B", "C")
    u, dt, B, C = (packed(rows, k).bfloat16() for k in keys)
    z = packed(rows, "z").bfloat16()
    cache = torch.randn(4, I, N, generator=gen)
    tcache = cache.clone()
    args = [u, dt, p["A"], B, C, p["D"], z, p["bias"], True]
    y_ref = selective_scan_ref(*args, cache, build_meta(rows, 16))
    y = selective_scan(*args, tcache, build_meta(rows, 16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    assert_close(tcache, cache, 1e-4)
