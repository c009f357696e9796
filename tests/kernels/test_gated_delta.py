"""The shared gated delta rule kernel with both decay shapes (GDN: per head; KDA: per key channel) against its
per-token / per-row references on random inputs: odd lengths, rows straddling pieces and chunks, GQA head
ratios, checkpoints at random positions, piece sizes 16 / 32 / 64; decode on runs of consecutive slots (updated
in place), scattered slots, padding rows, rows without context, and a bf16 state. States asserted."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update, gated_delta_rule_update_ref, slot_runs

from .cases import Row, assert_close, build_meta

DK, DV = 6, 5


def _inputs(gen: torch.Generator, t: int, hk: int, hv: int, per_channel: bool) -> tuple[torch.Tensor, ...]:
    q = l2_normalize(torch.randn(t, hk, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(t, hk, DK, generator=gen))
    v = torch.randn(t, hv, DV, generator=gen)
    g = -torch.rand(t, hv, *((DK,) if per_channel else ()), generator=gen) * 3  # strong decays too
    return q, k, v, g, torch.rand(t, hv, generator=gen)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("seed", range(4))
def test_chunked_matches_recurrent_reference(per_channel: bool, seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hk, hv = rng.choice([(1, 1), (2, 2), (1, 3), (2, 6)])
    rows: list[Row] = []
    slot = 0
    for _ in range(rng.randint(1, 3)):
        n, ctx = rng.randrange(1, 160, 2), rng.choice([0, rng.randint(1, 70)])
        cps = sorted(rng.sample(range(ctx + 1, ctx + n + 1), min(n, rng.randint(0, 5))))
        padding = rng.random() < 0.2
        rows.append(Row({"x": torch.zeros(n)}, ctx, slot, [] if padding else [(p, slot + 1 + i) for i, p in
                                                                              enumerate(cps)], padding))  # fmt: skip
        slot += 1 + len(cps)
    x = _inputs(gen, sum(r.n for r in rows), hk, hv, per_channel)
    before = torch.randn(slot, hv, DK, DV, generator=gen)
    meta = build_meta(rows, 64)
    ref_cache, ref_sp = before.clone(), torch.full((slot,), -3)
    y_ref = gated_delta_rule_ref(*x, ref_cache, meta, ref_sp)
    for piece in (16, 32, 64):
        cache, sp = before.clone(), torch.full((slot,), -3)
        y = gated_delta_rule(*x, cache, meta, sp, piece=piece)
        assert_close(y, y_ref, 5e-5)
        assert_close(cache, ref_cache, 5e-5)
        assert torch.equal(sp, ref_sp)


def test_slot_runs() -> None:
    rows = [(0, 4, True), (1, 5, False), (2, 6, True), (4, 7, True), (5, 9, True), (6, 10, True)]
    assert slot_runs(rows) == [(0, 4, 3), (4, 7, 1), (5, 9, 2)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("layout", ["consecutive", "scattered", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(per_channel: bool, layout: str, dtype: torch.dtype) -> None:
    gen, b, hk, hv = torch.Generator().manual_seed(7), 7, 2, 4
    slots = {"consecutive": [3, 4, 5, 6, 7, 8, 9], "scattered": [9, 1, 12, 5, 3, 7, 14],
             "mixed": [2, 3, PAD_SLOT_ID, 8, 9, 10, 0]}[layout]  # fmt: skip
    init = torch.tensor([True, False, True, True, True, False, True])
    q, k, v, g, beta = _inputs(gen, b, hk, hv, per_channel)
    before = torch.randn(16, hv, DK, DV, generator=gen).to(dtype)
    pos = torch.arange(b) * 3 + 17
    outs, caches, sps = [], [], []
    for fn in (gated_delta_rule_update, gated_delta_rule_update_ref):
        cache, sp = before.clone(), torch.full((16,), -5)
        outs.append(fn(cache, q, k, v, g, beta, torch.tensor(slots), sp, pos, init))
        caches.append(cache)
        sps.append(sp)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert_close(outs[0].float(), outs[1].float(), tol)
    assert_close(caches[0].float(), caches[1].float(), tol)
    assert torch.equal(sps[0], sps[1])
    untouched = [s for s in range(16) if s not in slots]
    assert torch.equal(caches[0][untouched], before[untouched])


def test_decode_updates_consecutive_slots_in_place() -> None:
    """A run of consecutive slots is updated through a view of the state: no copy of a state is made."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(gen, 4, 2, 4, False)
    state = torch.randn(6, 4, DK, DV, generator=gen)
    with torch.profiler.profile() as prof:
        gated_delta_rule_update(state, q, k, v, g, beta, torch.tensor([1, 2, 3, 4]))
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::index_select", "aten::index_copy_", "aten::index", "aten::index_put_"}, ops
