"""The mLSTM scan (kernels/mlstm.py) beyond the shared invariants (tests/kernels/cases.py runs those on it): the
reference equals transformers' own step loop and its chunkwise kernel (outputs, C, n and m: the stabilizer is
part of the output through eps), long rows over many chunks with a checkpoint at every block boundary (fresh
seeds, odd lengths, lengths straddling blocks), random packed steps with padding rows, a decode step."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.mlstm import _unpack, mlstm_scan, mlstm_scan_ref, state_width

from .cases import Row, assert_close, build_meta
from .mlstm_case import mlstm_inputs

SLOTS = 40


def _row(gen: torch.Generator, n: int, hkv: tuple, ctx: int, slot: int, cps: list | None = None) -> Row:
    return Row(mlstm_inputs(n, gen, *hkv), ctx, slot, cps or [])


def _both(rows: list[Row], before: torch.Tensor, chunk: int = 64, eps: float = 1e-6) -> tuple:
    meta = build_meta(rows, chunk)
    x = [torch.cat([r.inputs[n] for r in rows]) for n in ("q", "k", "v", "i", "f")]
    got, want = before.clone(), before.clone()
    sp_got, sp_want = torch.full((SLOTS,), -1), torch.full((SLOTS,), -1)
    y = mlstm_scan(*x, got, meta, sp_got, eps)
    assert_close(y, mlstm_scan_ref(*x, want, meta, sp_want, eps))
    assert_close(got, want)
    assert torch.equal(sp_got, sp_want)
    return y, got, sp_got


@pytest.mark.parametrize("n", [37, 64])  # the step loop alone; the chunkwise kernel alone (16-token chunks)
def test_reference_equals_transformers(n: int) -> None:
    """mlstm_scan_ref from the empty state is transformers' native CPU path (outputs and final C, n, m)."""
    from transformers.models.xlstm import modeling_xlstm as hf

    gen = torch.Generator().manual_seed(n)
    h, k, v = 2, 4, 3
    row = _row(gen, n, (h, k, v), 0, 1)
    x = row.inputs
    state = torch.randn(4, h, state_width(k, v), generator=gen)
    y = mlstm_scan_ref(x["q"], x["k"], x["v"], x["i"], x["f"], state, build_meta([row], 16), eps=1e-3)
    want, (c, nn, m) = hf.wrap_chunkwise_arbitrary_sequence_length(
        hf.mlstm_chunkwise_native_autograd, hf.mlstm_recurrent_sequence_native, hf.mlstm_recurrent_step_native,
        query=x["q"].transpose(0, 1)[None], key=x["k"].transpose(0, 1)[None], value=x["v"].transpose(0, 1)[None],
        fgate=x["f"].T[None], igate=x["i"].T[None], eps=1e-3, chunk_size=16,
    )  # fmt: skip
    assert_close(y, want[0].transpose(0, 1))
    got_c, got_n, got_m = _unpack(state[1], k, v)
    assert_close(got_c, c[0])
    assert_close(got_n, nn[0])
    assert_close(got_m, m[0, :, 0])


@pytest.mark.parametrize(("ctx", "n"), [(0, 63), (0, 64), (5, 129), (48, 200), (17, 1), (3, 16), (0, 17)])
def test_long_rows_checkpoint_every_block(ctx: int, n: int) -> None:
    """A row over several 64-token chunks, a checkpoint at every 16-token block boundary inside, from the empty
    state or its slot; a second row beside it; fast equals the reference, slots and positions too."""
    gen = torch.Generator().manual_seed(ctx * 1000 + n)
    hkv = (3, 5, 4)
    cps = [(p, 3 + k) for k, p in enumerate(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))]
    rows = [_row(gen, n, hkv, ctx, 1, cps), _row(gen, 9, hkv, 4, 2)]
    _, _, sp = _both(rows, torch.randn(SLOTS, 3, state_width(5, 4), generator=gen))
    assert [int(sp[s]) for _, s in cps] == [p for p, _ in cps] and int(sp[1]) == ctx + n


@pytest.mark.parametrize("seed", range(6))
def test_random_packed_steps(seed: int) -> None:
    """Fresh seeds: 1-5 rows of odd lengths (some straddling blocks), random contexts, checkpoints and a padding
    row, chunk grids of 8, 16 and 64, eps from transformers' 1e-6 to 1e-2."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(100 + seed)
    hkv = (rng.choice([1, 2, 4]), rng.choice([2, 8]), rng.choice([3, 16]))
    free = rng.sample(range(SLOTS), SLOTS)
    rows = []
    for _ in range(rng.randint(1, 5)):
        n, ctx = rng.choice([1, 7, 15, 17, 33, 61, 95]), rng.choice([0, 0, rng.randint(1, 40)])
        if rng.random() < 0.2:
            rows.append(Row(_row(gen, n, hkv, 0, 0).inputs, 0, PAD_SLOT_ID, padding=True))
            continue
        cps = sorted(rng.sample(range(ctx + 1, ctx + n + 1), k=min(n, rng.randint(0, 4))))
        rows.append(_row(gen, n, hkv, ctx, free.pop(), [(p, free.pop()) for p in cps]))
    before = torch.randn(SLOTS, hkv[0], state_width(hkv[1], hkv[2]), generator=gen)
    y, _, _ = _both(rows, before, chunk=rng.choice([8, 16, 64]), eps=rng.choice([1e-6, 1e-2]))
    qsl = build_meta(rows, 64).query_start_loc_list
    for r, row in enumerate(rows):
        if row.padding:
            assert not y[qsl[r] : qsl[r + 1]].any()


def test_decode_batch_with_checkpoints_matches_reference() -> None:
    """A decode step (one token per row) writes running slots, checkpoint copies and positions as the reference;
    a row without context does not read its slot."""
    gen = torch.Generator().manual_seed(11)
    hkv = (2, 3, 4)
    specs = [(5, 1), (0, 2), (9, 3), (0, PAD_SLOT_ID), (15, 6)]
    rows = [_row(gen, 1, hkv, ctx, slot, [(ctx + 1, 10 + r)] if r in (0, 2, 4) else []) for r, (ctx, slot) in
            enumerate(specs)]  # fmt: skip
    rows[3].padding = True
    assert build_meta(rows, 8).is_decode
    before = torch.randn(SLOTS, 2, state_width(3, 4), generator=gen)
    y, got, sp = _both(rows, before, chunk=8)
    assert not y[3].any() and int(sp[14]) == 16
    untouched = set(range(SLOTS)) - {1, 2, 3, 6, 10, 12, 14}
    assert all(torch.equal(got[s], before[s]) for s in untouched)
