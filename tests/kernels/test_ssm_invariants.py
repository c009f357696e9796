"""Invariants shared by the three SSM kernels (conv1d, Mamba1 scan, Mamba2 SSD), on random packed batches.

Fast equals reference (outputs and every slot); chunked at random splits equals one-shot; a checkpoint holds
the state after exactly its prefix; a packed batch equals each row alone; padding rows touch no slot; the
decode update equals the varlen kernel; slot_positions records the right positions.
"""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID

from .cases import CASES, Case, Row, assert_close, random_rows, slice_inputs

SLOTS = 40
SEEDS = range(10)
case_param = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


def _setup(seed: int) -> tuple[random.Random, torch.Generator]:
    return random.Random(seed), torch.Generator().manual_seed(seed)


def _used_slots(rows: list[Row]) -> set[int]:
    return {r.slot for r in rows if not r.padding} | {s for r in rows for _, s in r.checkpoints}


def _assert_untouched(after: torch.Tensor, before: torch.Tensor, used: set[int]) -> None:
    for s in range(before.shape[0]):
        if s not in used:
            assert torch.equal(after[s], before[s]), f"slot {s} is not in the batch but changed"


@case_param
@pytest.mark.parametrize("seed", SEEDS)
def test_fast_matches_reference(case: Case, seed: int) -> None:
    rng, gen = _setup(seed)
    rows = random_rows(case, rng, gen, SLOTS, max_len=rng.choice([1, 40]))
    params = case.params(gen)
    chunk = rng.choice([4, 8, 16])
    before = case.new_cache(SLOTS, gen)
    cache, cache_ref = before.clone(), before.clone()
    sp, sp_ref = torch.full((SLOTS,), -7), torch.full((SLOTS,), -7)
    ys = case.run("fast", rows, params, cache, chunk, sp)
    ys_ref = case.run("ref", rows, params, cache_ref, chunk, sp_ref)
    for row, y, y_ref in zip(rows, ys, ys_ref):
        assert_close(y, y_ref)
        if row.padding:
            assert not y.any()
    assert_close(cache, cache_ref)  # running slots and every checkpoint slot
    _assert_untouched(cache, before, _used_slots(rows))
    for row in rows:
        if not row.padding:
            assert not torch.equal(cache[row.slot], before[row.slot])
    if case.writes_positions:
        expected = torch.full((SLOTS,), -7)
        for row in rows:
            if not row.padding:
                expected[row.slot] = row.context_len + row.n
                for p, s in row.checkpoints:
                    expected[s] = p
        assert torch.equal(sp, expected)
        assert torch.equal(sp_ref, expected)


@case_param
@pytest.mark.parametrize("seed", SEEDS)
def test_chunked_equals_one_shot(case: Case, seed: int) -> None:
    """Run one request in random pieces (the slot carries the state) vs at once, with the same checkpoints."""
    rng, gen = _setup(seed)
    n = rng.randint(2, 90)
    ctx = rng.choice([0, rng.randint(1, 30)])
    inputs = case.token_inputs(n, gen)
    params = case.params(gen)
    chunk = rng.choice([4, 8, 16])
    cps = [(p, 2 + k) for k, p in enumerate(sorted(rng.sample(range(ctx + 1, ctx + n + 1), k=min(n, 3))))]
    before = case.new_cache(SLOTS, gen)
    one = before.clone()
    (y_one,) = case.run("fast", [Row(inputs, ctx, 1, cps)], params, one, chunk)

    cuts = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(1, 4))))
    pieces = []
    split = before.clone()
    for s, e in zip([0, *cuts], [*cuts, n]):
        mine = [(p, slot) for p, slot in cps if ctx + s < p <= ctx + e]
        (y,) = case.run("fast", [Row(slice_inputs(inputs, s, e), ctx + s, 1, mine)], params, split, chunk)
        pieces.append(y)
    assert_close(torch.cat(pieces), y_one)
    for slot in [1, *(s for _, s in cps)]:
        assert_close(split[slot], one[slot])


@case_param
@pytest.mark.parametrize("seed", SEEDS)
def test_checkpoint_equals_prefix_state(case: Case, seed: int) -> None:
    rng, gen = _setup(seed)
    n = rng.randint(3, 70)
    ctx = rng.choice([0, rng.randint(1, 30)])
    inputs = case.token_inputs(n, gen)
    params = case.params(gen)
    chunk = rng.choice([4, 8, 16])
    positions = sorted(rng.sample(range(ctx + 1, ctx + n + 1), k=3))
    before = case.new_cache(SLOTS, gen)
    cache = before.clone()
    case.run("fast", [Row(inputs, ctx, 1, [(p, 10 + k) for k, p in enumerate(positions)])], params, cache, chunk)
    for k, p in enumerate(positions):
        prefix = before.clone()
        case.run("ref", [Row(slice_inputs(inputs, 0, p - ctx), ctx, 1)], params, prefix, chunk)
        assert_close(cache[10 + k], prefix[1])


@case_param
@pytest.mark.parametrize("seed", SEEDS)
def test_packed_equals_each_row_alone(case: Case, seed: int) -> None:
    rng, gen = _setup(seed)
    rows = random_rows(case, rng, gen, SLOTS)
    params = case.params(gen)
    chunk = rng.choice([4, 8, 16])
    before = case.new_cache(SLOTS, gen)
    packed = before.clone()
    ys = case.run("fast", rows, params, packed, chunk)
    for row, y in zip(rows, ys):
        alone = before.clone()
        (y_alone,) = case.run("fast", [row], params, alone, chunk)
        assert_close(y, y_alone)
        for slot in _used_slots([row]):
            assert_close(packed[slot], alone[slot])


@case_param
@pytest.mark.parametrize("impl", ["fast", "ref"])
def test_padding_rows_touch_no_slot(case: Case, impl: str) -> None:
    rng, gen = _setup(123)
    pads = [Row(case.token_inputs(n, gen), 0, PAD_SLOT_ID, padding=True) for n in (1, 7, 20)]
    params = case.params(gen)
    before = case.new_cache(SLOTS, gen)
    cache = before.clone()
    sp = torch.full((SLOTS,), -3)
    for rows in (pads, pads[:1] + [Row(case.token_inputs(1, gen), 5, 4)]):  # all-padding; padding + decode
        ys = case.run(impl, rows, params, cache, 8, sp)
        assert all(not y.any() for row, y in zip(rows, ys) if row.padding)
    _assert_untouched(cache, before, {4})
    assert torch.equal(sp != -3, torch.arange(SLOTS) == 4) or not case.writes_positions


@case_param
@pytest.mark.parametrize("seed", range(4))
def test_decode_update_equals_varlen(case: Case, seed: int) -> None:
    """The update kernel on 1-token rows equals the varlen kernel (general path: one row has 2 tokens)."""
    rng, gen = _setup(seed)
    params = case.params(gen)
    before = case.new_cache(SLOTS, gen)
    slots = [3, PAD_SLOT_ID, 7, 11]
    ctxs = [rng.randint(1, 40) for _ in slots]
    tokens = [case.token_inputs(1, gen) for _ in slots]
    rows = [Row(t, c, s, padding=s == PAD_SLOT_ID) for t, c, s in zip(tokens, ctxs, slots)]
    rows.append(Row(case.token_inputs(2, gen), 9, 20))  # keeps the batch off the decode path
    varlen = before.clone()
    sp_varlen = torch.full((SLOTS,), -1)
    ys = case.run("fast", rows, params, varlen, 8, sp_varlen)
    upd = before.clone()
    sp_upd = torch.full((SLOTS,), -1)
    inputs = {k: torch.cat([t[k] for t in tokens]) for k in tokens[0]}
    y_upd = case.update(inputs, params, upd, torch.tensor(slots), sp_upd, torch.tensor(ctxs))
    assert_close(y_upd, torch.cat(ys[: len(slots)]))
    assert not y_upd[1].any()
    for s in (3, 7, 11):
        assert_close(upd[s], varlen[s])
    _assert_untouched(upd, before, {3, 7, 11})
    if case.writes_positions:
        for s, c in zip(slots, ctxs):
            if s != PAD_SLOT_ID:
                assert sp_upd[s] == c + 1 == sp_varlen[s]


@case_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_and_tracks_fp32(case: Case, dtype: torch.dtype) -> None:
    rng, gen = _setup(7)
    rows = random_rows(case, rng, gen, SLOTS, padding=False)
    params = case.params(gen)
    before = case.new_cache(SLOTS, gen)
    cache32 = before.clone()
    ys32 = case.run("fast", rows, params, cache32, 8)
    low = [Row({k: v.to(dtype) for k, v in r.inputs.items()}, r.context_len, r.slot, r.checkpoints) for r in rows]
    cache = before.to(dtype)
    ys = case.run("fast", low, {k: v.to(dtype) for k, v in params.items()}, cache, 8)
    for y, y32 in zip(ys, ys32):
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), y32, rtol=0.1, atol=0.15)
    torch.testing.assert_close(cache.float(), cache32, rtol=0.1, atol=0.15)
