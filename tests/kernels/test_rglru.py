"""The RG-LRU scan (kernels/rglru.py) beyond the shared invariants (tests/kernels/cases.py runs those on it):
long rows over many chunks with a checkpoint at every block boundary, extreme decays, a decode batch with
checkpoints, and the recurrence itself written out by hand."""

from __future__ import annotations

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.rglru import rglru_scan, rglru_scan_ref

from .cases import Row, assert_close, build_meta

SLOTS = 40


@pytest.mark.parametrize(("ctx", "n"), [(0, 63), (0, 64), (5, 129), (48, 200), (17, 1)])
def test_long_rows_checkpoint_every_block(ctx: int, n: int) -> None:
    """A row over several 64-token chunks (lengths straddling them), a checkpoint at every block boundary inside,
    from zeros or from its slot; a second row beside it; fast equals the reference, slots and positions too."""
    gen = torch.Generator().manual_seed(ctx * 1000 + n)
    w = 33
    cps = [(p, 3 + k) for k, p in enumerate(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))]
    rows = [Row({"x": torch.randn(n, w, generator=gen), "a": torch.rand(n, w, generator=gen)}, ctx, 1, cps),
            Row({"x": torch.randn(9, w, generator=gen), "a": torch.rand(9, w, generator=gen)}, 4, 2)]  # fmt: skip
    meta = build_meta(rows, 64)
    x, a = (torch.cat([r.inputs[k] for r in rows]) for k in ("x", "a"))
    before = torch.randn(SLOTS, w, generator=gen)
    got, want = before.clone(), before.clone()
    sp_got, sp_want = torch.full((SLOTS,), -1), torch.full((SLOTS,), -1)
    assert_close(rglru_scan(x, a, got, meta, sp_got), rglru_scan_ref(x, a, want, meta, sp_want))
    assert_close(got, want)
    assert torch.equal(sp_got, sp_want)
    assert [int(sp_got[s]) for _, s in cps] == [p for p, _ in cps] and int(sp_got[1]) == ctx + n


def test_extreme_decays_stay_exact() -> None:
    """a = 0 (a reset), tiny, exactly 1 and 1 - 1e-7 over 300 tokens: the log-depth form never overflows."""
    gen = torch.Generator().manual_seed(3)
    n, w = 300, 4
    a = torch.tensor([0.0, 1e-30, 1.0, 1 - 1e-7]).expand(n, w).clone()
    a[::37, 0] = 0.5
    x = torch.randn(n, w, generator=gen)
    meta = build_meta([Row({"x": x, "a": a}, 7, 0)], 64)
    state = torch.randn(2, w, generator=gen)
    h0 = state[0].clone()
    y = rglru_scan(x, a, state, meta)
    h, expected = h0, []
    for t in range(n):  # the recurrence written out
        h = a[t] * h + x[t]
        expected.append(h)
    assert torch.isfinite(y).all()
    assert_close(y, torch.stack(expected), tol=1e-4)
    assert_close(state[0], expected[-1], tol=1e-4)


def test_decode_batch_with_checkpoints_matches_reference() -> None:
    """A decode step (one token per row) writes running slots, checkpoint copies and positions as the reference."""
    gen = torch.Generator().manual_seed(11)
    w = 6
    specs = [(5, 1), (0, 2), (9, 3), (0, PAD_SLOT_ID), (15, 6)]
    rows = [
        Row({"x": torch.randn(1, w, generator=gen), "a": torch.rand(1, w, generator=gen)}, ctx, slot,
            [(ctx + 1, 10 + r)] if r in (0, 2, 4) else [], padding=slot == PAD_SLOT_ID)
        for r, (ctx, slot) in enumerate(specs)
    ]  # fmt: skip
    meta = build_meta(rows, 8)
    assert meta.is_decode
    x, a = (torch.cat([r.inputs[k] for r in rows]) for k in ("x", "a"))
    before = torch.randn(SLOTS, w, generator=gen)
    got, want = before.clone(), before.clone()
    sp_got, sp_want = torch.full((SLOTS,), -2), torch.full((SLOTS,), -2)
    y = rglru_scan(x, a, got, meta, sp_got)
    assert_close(y, rglru_scan_ref(x, a, want, meta, sp_want))
    assert not y[3].any()
    assert_close(got, want)
    assert torch.equal(sp_got, sp_want) and int(sp_got[14]) == 16
    assert torch.equal(got[2], x[1])  # no context: the slot's old content is not read
    untouched = set(range(SLOTS)) - {1, 2, 3, 6, 10, 12, 14}
    assert all(torch.equal(got[s], before[s]) for s in untouched)
