"""SSD checkpoints inside sub-chunks: ssd keeps its sub-chunks whole and cuts only the state pass at
checkpoint positions (segments). Fast vs the per-token reference on random packed steps, the chunking it
plans, and the cache paths (in place in an fp32 cache, staged otherwise)."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.ssd import ssd, ssd_ref
from recap.kernels.tiling import SegmentPlan, plan_segments

from .cases import Row, assert_close, build_meta

H, P, N = 4, 3, 5
UNWRITTEN = -7
TOKEN_KEYS = ("x", "dt", "B", "C")  # per-token inputs; the others are per-head parameters


def _checkpoints(rng: random.Random, ctx: int, n: int, chunk: int, sub: int) -> list[int]:
    """Positions in (ctx, ctx + n]: block boundaries (16), sub-chunk ends, several inside one sub-chunk, random."""
    lo, hi = ctx + 1, ctx + n
    cell = (ctx // chunk + 1) * chunk  # first grid cut after ctx; sub-chunks run from ctx, then from each cut
    sub_ends = [p for p in range(ctx + sub, min(cell, hi + 1), sub)] + [
        c + k for c in range(cell, hi + 1, chunk) for k in range(0, chunk, sub) if lo <= c + k <= hi
    ]
    blocks = list(range((ctx // 16 + 1) * 16, hi + 1, 16))
    start = rng.randint(lo, hi)
    inside = list(range(start, min(start + sub - 1, hi + 1), max(1, sub // 5)))  # several in one sub-chunk
    pool = {
        *rng.sample(blocks, k=min(len(blocks), rng.randint(0, 6))),
        *rng.sample(sub_ends, k=min(len(sub_ends), rng.randint(0, 2))),
        *inside[: rng.randint(2, 4)],
        *(rng.randint(lo, hi) for _ in range(rng.randint(0, 3))),
    }
    return sorted(pool)


def _random_step(seed: int, groups: int, sub: int) -> tuple[list[Row], dict[str, torch.Tensor], int, int]:
    """2-4 rows of odd lengths and different contexts (one maybe a padding row) with checkpoints."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    chunk = rng.choice([32, 128, 256])
    rows: list[Row] = []
    slot = 0
    for i in range(rng.randint(2, 4)):
        n = rng.randrange(1, 260, 2)
        if i > 0 and rng.random() < 0.3:
            rows.append(Row({"x": torch.zeros(n)}, 0, PAD_SLOT_ID, padding=True))
            continue
        ctx = rng.choice([0, rng.randint(1, 300)])
        cps = _checkpoints(rng, ctx, n, chunk, sub)
        rows.append(Row({"x": torch.zeros(n)}, ctx, slot, [(p, slot + 1 + k) for k, p in enumerate(cps)]))
        slot += 1 + len(cps)
    t = sum(r.n for r in rows)
    inputs = {
        "x": torch.randn(t, H, P, generator=gen),
        "dt": torch.randn(t, H, generator=gen) * 1.5,
        "A": -torch.rand(H, generator=gen) * 3 - torch.tensor([0.0, 0.0, 0.0, 30.0]),  # one fast-decaying head
        "B": torch.randn(t, groups, N, generator=gen),
        "C": torch.randn(t, groups, N, generator=gen),
        "D": torch.randn(H, generator=gen),
        "dt_bias": torch.randn(H, generator=gen),
    }
    return rows, inputs, chunk, slot + 3  # three slots that no row uses


def _args(inp: dict[str, torch.Tensor]) -> tuple:
    return inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], True, (0.0, float("inf"))


def _run_both(
    inp: dict[str, torch.Tensor], meta: SSMMetadata, cache: torch.Tensor, sub: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fast, ref = cache.clone(), cache.clone()
    sp = torch.full((cache.shape[0],), UNWRITTEN)
    sp_ref = sp.clone()
    y = ssd(*_args(inp), fast, meta, sp, sub_chunk=sub)
    y_ref = ssd_ref(*_args(inp), ref, meta, sp_ref)
    return y, y_ref, fast, ref, torch.stack([sp, sp_ref])


@pytest.mark.parametrize("seed", range(100, 112))
@pytest.mark.parametrize(("groups", "sub"), [(1, 64), (2, 64), (1, 16), (2, 7)])
def test_ssd_checkpoints_inside_sub_chunks_match_reference(seed: int, groups: int, sub: int) -> None:
    rows, inp, chunk, slots = _random_step(seed, groups, sub)
    meta = build_meta(rows, chunk)
    gen = torch.Generator().manual_seed(seed)
    before = torch.randn(slots, H, P, N, generator=gen)
    y, y_ref, cache, cache_ref, sps = _run_both(inp, meta, before, sub)
    assert_close(y, y_ref, tol=5e-5)
    assert_close(cache, cache_ref, tol=5e-5)
    expected = torch.full((slots,), UNWRITTEN)
    for r in rows:
        if not r.padding:
            expected[r.slot] = r.context_len + r.n
            for p, s in r.checkpoints:
                expected[s] = p
    assert torch.equal(sps[0], expected)
    assert torch.equal(sps[1], expected)
    unused = (expected == UNWRITTEN).nonzero().flatten()
    assert unused.numel() >= 3
    assert torch.equal(cache[unused], before[unused])  # padding rows and unused slots: untouched
    qsl = meta.query_start_loc_list
    for i, r in enumerate(rows):
        if r.padding:
            assert not y[qsl[i] : qsl[i + 1]].any()


def _plan(meta: SSMMetadata) -> SegmentPlan:
    return plan_segments(meta.chunks, meta.state_indices_list, meta.chunk_size, 64)


def _long_row_meta(ctx: int, n: int, every: int) -> SSMMetadata:
    cps = [(p, 1 + k) for k, p in enumerate(range((ctx // every + 1) * every, ctx + n + 1, every))]
    return build_meta([Row({"x": torch.zeros(n)}, ctx, 0, cps)], 256)


def test_checkpoints_do_not_cut_sub_chunks() -> None:
    """The engine's block checkpoints (every 16 tokens) leave the sub-chunks of the grid as they are, and
    every checkpoint is the end of a segment of exactly the tokens up to it."""
    for ctx, n in [(0, 2048), (100, 901)]:
        with_cps, without = _long_row_meta(ctx, n, 16), _long_row_meta(ctx, n, 10**9)
        assert len(with_cps.chunk_seq_idx_list) > len(without.chunk_seq_idx_list)  # the metadata cuts
        plan, bare = _plan(with_cps), _plan(without)
        assert plan.cu == bare.cu  # the SSD chunks do not
        assert not bare.split and plan.split
        cu = plan.cu
        for seg, slot, pos in plan.checkpoints:
            c, _, end = plan.segments[seg]
            assert cu[c] + end == pos - ctx
            assert pos % 16 == 0 and slot == 1 + (pos // 16 - ctx // 16 - 1)
        assert [(c, s) for c, s, _ in plan.running] == [(len(cu) - 2, 0)]


@pytest.mark.parametrize(("ctx", "n"), [(0, 512), (37, 333)])
def test_block_checkpoints_long_row_match_reference(ctx: int, n: int) -> None:
    """A checkpoint at every block boundary of a long row (the benchmarked policy), full and ragged sub-chunks."""
    gen = torch.Generator().manual_seed(ctx + n)
    inp = {
        "x": torch.randn(n, H, P, generator=gen),
        "dt": torch.randn(n, H, generator=gen),
        "A": -torch.rand(H, generator=gen) * 2,
        "B": torch.randn(n, 1, N, generator=gen),
        "C": torch.randn(n, 1, N, generator=gen),
        "D": torch.randn(H, generator=gen),
        "dt_bias": torch.randn(H, generator=gen),
    }
    meta = _long_row_meta(ctx, n, 16)
    before = torch.randn(2 + n // 16, H, P, N, generator=gen)
    y, y_ref, cache, cache_ref, sps = _run_both(inp, meta, before, 64)
    assert_close(y, y_ref, tol=5e-5)
    assert_close(cache, cache_ref, tol=5e-5)
    assert torch.equal(sps[0], sps[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_cache_dtype_stages_inner_checkpoints(dtype: torch.dtype) -> None:
    """A cache that is not fp32 cannot hold the states while they are carried: they go through a staging
    buffer, with the same result."""
    rows, inp, chunk, slots = _random_step(7, 1, 64)
    meta = build_meta(rows, chunk)
    before = torch.randn(slots, H, P, N, generator=torch.Generator().manual_seed(7)).to(dtype)
    y, y_ref, cache, cache_ref, sps = _run_both(inp, meta, before, 64)
    assert _plan(meta).split
    assert_close(y, y_ref, tol=5e-5)
    tol = 5e-5 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(cache.double(), cache_ref.double(), rtol=tol, atol=tol)
    assert torch.equal(sps[0], sps[1])


def test_shared_checkpoint_slot_keeps_the_carry_right() -> None:
    """Two checkpoints inside one sub-chunk naming the same slot (not something the scheduler plans): the
    states are staged, so the outputs and the running state stay exact; the slot holds one of the two."""
    gen = torch.Generator().manual_seed(11)
    n = 50
    inp = {
        "x": torch.randn(n, H, P, generator=gen),
        "dt": torch.randn(n, H, generator=gen),
        "A": -torch.rand(H, generator=gen),
        "B": torch.randn(n, 1, N, generator=gen),
        "C": torch.randn(n, 1, N, generator=gen),
        "D": torch.randn(H, generator=gen),
        "dt_bias": torch.randn(H, generator=gen),
    }
    meta = build_meta([Row({"x": torch.zeros(n)}, 5, 0, [(12, 2), (20, 2)])], 256)
    before = torch.randn(3, H, P, N, generator=gen)
    y, y_ref, cache, cache_ref, _ = _run_both(inp, meta, before, 64)
    assert_close(y, y_ref)
    assert_close(cache[0], cache_ref[0])
    states = {12: ssd_ref_prefix(inp, 12 - 5, before), 20: ssd_ref_prefix(inp, 20 - 5, before)}
    assert any(torch.allclose(cache[2], s, rtol=2e-5, atol=2e-5) for s in states.values())


def ssd_ref_prefix(inp: dict[str, torch.Tensor], k: int, before: torch.Tensor) -> torch.Tensor:
    """The state after the first k new tokens of the row in slot 0 (context 5), by the reference."""
    cache = before.clone()
    prefix = {key: v[:k] if key in TOKEN_KEYS else v for key, v in inp.items()}
    ssd_ref(*_args(prefix), cache, build_meta([Row({"x": torch.zeros(k)}, 5, 0)], 256))
    return cache[0]


def test_every_layer_of_a_step_shares_one_segment_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is derived once per step's metadata (layers cut the step alike), and a layer that reuses it
    computes what a fresh plan gives: a second layer's inputs on the same metadata equal a fresh metadata's."""
    import recap.kernels.metadata as metadata_module

    rows, inp, chunk, slots = _random_step(7, 2, 64)
    g = torch.Generator().manual_seed(8)  # another layer: other activations over the same step
    inp2 = {**inp, "x": torch.randn(inp["x"].shape, generator=g), "B": torch.randn(inp["B"].shape, generator=g)}
    calls: list[int] = []
    monkeypatch.setattr(metadata_module, "plan_segments", lambda *a: calls.append(1) or plan_segments(*a))
    meta, fresh = build_meta(rows, chunk), build_meta(rows, chunk)
    cache = torch.randn(slots, H, P, N, generator=torch.Generator().manual_seed(3))
    y1 = ssd(*_args(inp), cache.clone(), meta, sub_chunk=64)
    shared, alone = cache.clone(), cache.clone()
    y2 = ssd(*_args(inp2), shared, meta, sub_chunk=64)
    assert calls == [1] and meta.cached(("segments", 64), lambda: None) is not None
    assert torch.equal(y2, ssd(*_args(inp2), alone, fresh, sub_chunk=64)) and torch.equal(shared, alone)
    assert not torch.equal(y1, y2)
