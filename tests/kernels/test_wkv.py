"""The WKV scan (kernels/wkv.py) beyond the shared invariants (tests/kernels/cases.py runs those on it): the
reference equals transformers' own CPU recurrence, long rows over many chunks with a checkpoint at every block
boundary (fresh seeds, odd lengths, lengths straddling blocks), decays from none to total, and a decode step."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.wkv import wkv_scan, wkv_scan_ref

from .cases import Row, assert_close, build_meta, wkv_params, wkv_state

SLOTS = 40


def _row(gen: torch.Generator, n: int, a: int, ctx: int, slot: int, cps: list | None = None) -> Row:
    return Row({"k": torch.randn(n, a, generator=gen) * 3, "v": torch.randn(n, a, generator=gen)}, ctx, slot,
               cps or [])  # fmt: skip


def _both(rows: list[Row], p: dict, before: torch.Tensor, chunk: int = 64, tol: float = 1e-5) -> tuple:
    meta = build_meta(rows, chunk)
    k, v = (torch.cat([r.inputs[n] for r in rows]) for n in ("k", "v"))
    got, want = before.clone(), before.clone()
    sp_got, sp_want = torch.full((SLOTS,), -1), torch.full((SLOTS,), -1)
    y = wkv_scan(k, v, p["w"], p["u"], got, meta, sp_got)
    assert_close(y, wkv_scan_ref(k, v, p["w"], p["u"], want, meta, sp_want), tol=tol)
    assert_close(got, want, tol=tol)
    assert torch.equal(sp_got, sp_want)
    return y, got, sp_got


def test_reference_equals_transformers_recurrence() -> None:
    """wkv_scan_ref from the empty state is transformers' rwkv_linear_attention_cpu (outputs and final state)."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    gen = torch.Generator().manual_seed(0)
    n, a = 37, 8
    row = _row(gen, n, a, 0, 1)
    time_decay, u = torch.randn(a, generator=gen), torch.randn(a, generator=gen)
    meta = build_meta([row], 16)
    state = wkv_state(4, gen, a)
    y = wkv_scan_ref(row.inputs["k"], row.inputs["v"], -torch.exp(time_decay), u, state, meta)
    want, hf_state = rwkv_linear_attention_cpu(time_decay, u, row.inputs["k"][None], row.inputs["v"][None],
                                               return_state=True)  # fmt: skip
    assert torch.equal(y, want[0])
    assert torch.equal(state[1], torch.stack([s[0] for s in hf_state]))


@pytest.mark.parametrize(("ctx", "n"), [(0, 63), (0, 64), (5, 129), (48, 200), (17, 1), (3, 16), (0, 17)])
def test_long_rows_checkpoint_every_block(ctx: int, n: int) -> None:
    """A row over several 64-token chunks, a checkpoint at every 16-token block boundary inside, from the empty
    state or its slot; a second row beside it; fast equals the reference, slots and positions too."""
    gen = torch.Generator().manual_seed(ctx * 1000 + n)
    a = 33
    cps = [(p, 3 + k) for k, p in enumerate(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))]
    rows = [_row(gen, n, a, ctx, 1, cps), _row(gen, 9, a, 4, 2)]
    _, _, sp = _both(rows, wkv_params(gen, a), wkv_state(SLOTS, gen, a))
    assert [int(sp[s]) for _, s in cps] == [p for p, _ in cps] and int(sp[1]) == ctx + n


@pytest.mark.parametrize("seed", range(6))
def test_random_packed_steps(seed: int) -> None:
    """Fresh seeds: 1-5 rows of odd lengths (some straddling blocks), random contexts, checkpoints and a padding
    row, chunk grids of 8, 16 and 64."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(100 + seed)
    a = rng.choice([5, 16, 31])
    free = rng.sample(range(SLOTS), SLOTS)
    rows = []
    for _ in range(rng.randint(1, 5)):
        n, ctx = rng.choice([1, 7, 15, 17, 33, 61, 95]), rng.choice([0, 0, rng.randint(1, 40)])
        if rng.random() < 0.2:
            rows.append(Row(_row(gen, n, a, 0, 0).inputs, 0, PAD_SLOT_ID, padding=True))
            continue
        cps = sorted(rng.sample(range(ctx + 1, ctx + n + 1), k=min(n, rng.randint(0, 4))))
        rows.append(_row(gen, n, a, ctx, free.pop(), [(p, free.pop()) for p in cps]))
    y, _, _ = _both(rows, wkv_params(gen, a), wkv_state(SLOTS, gen, a), chunk=rng.choice([8, 16, 64]))
    qsl = build_meta(rows, 64).query_start_loc_list
    for r, row in enumerate(rows):
        if row.padding:
            assert not y[qsl[r] : qsl[r + 1]].any()


def test_extreme_decays_and_keys_stay_finite() -> None:
    """Decays from none (w = -1e-9) to total (w = -1e4), keys of +-60 over 300 tokens: no overflow, and the fast
    form equals the sequential reference (to 2e-4: at a max exponent of 60 an fp32 step of -0.01 keeps ~3 digits,
    which the reference rounds once per token and the blocked form once per block)."""
    gen = torch.Generator().manual_seed(3)
    n, a = 300, 4
    p = {"w": torch.tensor([-1e-9, -0.01, -5.0, -1e4]), "u": torch.randn(a, generator=gen)}
    row = _row(gen, n, a, 7, 0)
    row.inputs["k"][::29] = 60.0
    row.inputs["k"][5::31] = -60.0
    y, state, _ = _both([row], p, wkv_state(SLOTS, gen, a), tol=2e-4)
    assert torch.isfinite(y).all() and torch.isfinite(state).all()


def test_decode_batch_with_checkpoints_matches_reference() -> None:
    """A decode step (one token per row) writes running slots, checkpoint copies and positions as the reference;
    a row without context does not read its slot."""
    gen = torch.Generator().manual_seed(11)
    a = 6
    specs = [(5, 1), (0, 2), (9, 3), (0, PAD_SLOT_ID), (15, 6)]
    rows = [_row(gen, 1, a, ctx, slot, [(ctx + 1, 10 + r)] if r in (0, 2, 4) else []) for r, (ctx, slot) in
            enumerate(specs)]  # fmt: skip
    rows[3].padding = True
    assert build_meta(rows, 8).is_decode
    before = wkv_state(SLOTS, gen, a)
    y, got, sp = _both(rows, wkv_params(gen, a), before, chunk=8)
    assert not y[3].any() and int(sp[14]) == 16
    assert torch.equal(y[1], rows[1].inputs["v"][0])  # no context: the output is the token's own value
    untouched = set(range(SLOTS)) - {1, 2, 3, 6, 10, 12, 14}
    assert all(torch.equal(got[s], before[s]) for s in untouched)
