"""Gated delta rule kernels beyond the shared invariants (tests/kernels/test_ssm_invariants.py runs those on
GDN too): the math equals transformers' torch forms (Qwen3.5 / Qwen3-Next), long rows straddling chunks with
a checkpoint at every block equal the per-token reference (states asserted), and a long row prefilled in
random pieces equals one shot, checkpoints included."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, gdn_gates, l2_normalize

from .cases import Row, assert_close, build_meta

DK, DV = 8, 6


def _inputs(gen: torch.Generator, t: int, hk: int, hv: int) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(t, hk, DK, generator=gen),
        "k": torch.randn(t, hk, DK, generator=gen),
        "v": torch.randn(t, hv, DV, generator=gen),
        "a": torch.randn(t, hv, generator=gen),
        "b": torch.randn(t, hv, generator=gen),
        "A_log": torch.rand(hv, generator=gen) * 2 - 1,
        "dt_bias": torch.randn(hv, generator=gen),
    }


def _args(x: dict[str, torch.Tensor], start: int = 0, end: int | None = None) -> tuple[torch.Tensor, ...]:
    sl = slice(start, end)
    g, beta = gdn_gates(x["a"][sl], x["b"][sl], x["A_log"], x["dt_bias"])
    return l2_normalize(x["q"][sl]) * DK**-0.5, l2_normalize(x["k"][sl]), x["v"][sl], g, beta


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("t", [1, 37, 130])
def test_matches_transformers_torch_forms(hk: int, hv: int, t: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(t * 10 + hv)
    x = _inputs(gen, t, hk, hv)
    h0 = torch.randn(1, hv, DK, DV, generator=gen)
    g, beta = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    hf_args = (x["q"][None], x["k"][None], x["v"][None])
    kw = {"g": g[None], "beta": beta[None], "initial_state": h0, "output_final_state": True,
          "use_qk_l2norm_in_kernel": True}  # fmt: skip
    o_chunk, s_chunk = torch_chunk_gated_delta_rule(*hf_args, **kw)
    o_rec, s_rec = torch_recurrent_gated_delta_rule(*hf_args, **kw)
    cache = torch.zeros(3, hv, DK, DV)
    cache[1] = h0[0]
    meta = build_meta([Row({"x": torch.zeros(t)}, 5, 1)], 64)
    y = gated_delta_rule(*_args(x), cache, meta)
    for o, s in ((o_chunk, s_chunk), (o_rec, s_rec)):
        assert_close(y, o[0], 1e-5)
        assert_close(cache[1], s[0], 1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_long_rows_with_block_checkpoints_match_reference(seed: int) -> None:
    """Rows of 100-300 tokens from odd contexts, chunk grid 64, a checkpoint at every 16-token block."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hk, hv = rng.choice([(2, 2), (1, 4)])
    rows: list[Row] = []
    slot = 0
    for _ in range(rng.randint(1, 3)):
        n, ctx = rng.randrange(101, 301, 2), rng.choice([0, rng.randint(1, 90)])
        cps = list(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))
        rows.append(Row({"x": torch.zeros(n)}, ctx, slot, [(p, slot + 1 + i) for i, p in enumerate(cps)]))
        slot += 1 + len(cps)
    t = sum(r.n for r in rows)
    x = _inputs(gen, t, hk, hv)
    before = torch.randn(slot, hv, DK, DV, generator=gen)
    meta = build_meta(rows, 64)
    outs, caches, sps = [], [], []
    for fn in (gated_delta_rule, gated_delta_rule_ref):
        cache, sp = before.clone(), torch.full((slot,), -3)
        outs.append(fn(*_args(x), cache, meta, sp))
        caches.append(cache)
        sps.append(sp)
    assert_close(outs[0], outs[1], 5e-5)
    assert_close(caches[0], caches[1], 5e-5)
    assert torch.equal(sps[0], sps[1])
    for r in rows:
        assert all(sps[0][s] == p for p, s in r.checkpoints)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_in_random_pieces_equals_one_shot(seed: int) -> None:
    """One 250-token row, split at random points (a scheduler's chunked prefill), with checkpoints."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(100 + seed)
    n, hk, hv = 250, 2, 4
    x = _inputs(gen, n, hk, hv)
    cps = sorted(rng.sample(range(1, n + 1), 6))
    dest = {p: 2 + i for i, p in enumerate(cps)}
    one = torch.zeros(10, hv, DK, DV)
    meta = build_meta([Row({"x": torch.zeros(n)}, 0, 1, [(p, dest[p]) for p in cps])], 64)
    y_one = gated_delta_rule(*_args(x), one, meta)
    cuts = [0, *sorted(rng.sample(range(1, n), 4)), n]
    pieces = torch.zeros(10, hv, DK, DV)
    ys = []
    for a, b in zip(cuts, cuts[1:]):
        mine = [(p, dest[p]) for p in cps if a < p <= b]
        meta = build_meta([Row({"x": torch.zeros(b - a)}, a, 1, mine)], 64)
        ys.append(gated_delta_rule(*_args(x, a, b), pieces, meta))
    assert_close(torch.cat(ys), y_one, 5e-5)
    assert_close(pieces, one, 5e-5)
