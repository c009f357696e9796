"""Qwen4-Exp's QSA: the batched selection equals its per-query twin; paged QSA attention, fast vs reference on
mixed batches (prefill, prefill over a cached prefix, decode, padding) on shuffled blocks with NaN wherever no
row may read; chunked steps over the cache (raw indexer keys read back from the blocks) vs one whole pass."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.qsa import QSAShape, paged_qsa_attention, paged_qsa_attention_ref, qsa_select, qsa_select_ref

BLOCK, NUM_BLOCKS = 4, 64
HQ, HKV, DH, HI, DI = 4, 2, 6, 8, 6
SHAPE = QSAShape(budget=6, ratio=3, norm_eps=1e-6, rotary_dim=4)
INV_FREQ = 1.0 / (100.0 ** (torch.arange(0, 4, 2).float() / 4))


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _caches(fill: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.full((NUM_BLOCKS, BLOCK, h, d), fill) for h, d in ((HKV, DH), (HKV, DH), (1, DI)))  # type: ignore[return-value]


def _tokens(gen: torch.Generator, t: int) -> list[torch.Tensor]:
    sizes = ((t, HQ, DH), (t, HKV, DH), (t, HKV, DH), (t, HI, DI), (t, DI))  # q, k, v, index q, raw index key
    return [torch.randn(size, generator=gen) for size in sizes]


def _attend(x: list[torch.Tensor], caches: tuple, meta: AttentionMetadata, w: torch.Tensor,
            fast: bool = True) -> torch.Tensor:  # fmt: skip
    op = paged_qsa_attention if fast else paged_qsa_attention_ref
    return op(*x, caches, meta, w, INV_FREQ, SHAPE, 0.4)


@pytest.mark.parametrize("seed", range(6))
def test_selection_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ctx, n = seed * 3, 1 + seed * 4
    q, keys, w = torch.randn(n, HI, DI, generator=gen), torch.randn(ctx + n, DI, generator=gen), torch.randn(DI)
    got = qsa_select(q, keys, w, INV_FREQ, ctx, SHAPE)
    assert torch.equal(got, qsa_select_ref(q, keys, w, INV_FREQ, ctx, SHAPE))
    r = SHAPE.ratio
    for i in range(n):  # at most budget tokens of whole blocks, plus the query's own incomplete block
        t = ctx + i
        tail = got[i, t + 1 - (t + 1) % r : t + 1]
        assert int(got[i].sum()) <= SHAPE.budget + (t + 1) % r and tail.all() and not got[i, t + 1 :].any()


@pytest.mark.parametrize("seed", range(8))
def test_fast_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    w = torch.randn(DI, generator=gen) * 0.1
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    specs, caches = [], _caches(float("nan"))
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["scratch", "prefix", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, 13)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, 30)
        blocks = [free.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        for p in range(ctx):  # the cached prefix: finite values where the row reads
            for cache in caches:
                cache[blocks[p // BLOCK], p % BLOCK] = torch.randn(cache.shape[2:], generator=gen)
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=blocks))
    meta = _meta(specs)
    x = _tokens(gen, sum(len(s.token_ids) for s in specs))
    ref_caches = tuple(t.clone() for t in caches)
    out = _attend(x, caches, meta, w)
    ref = _attend(x, ref_caches, meta, w, fast=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for r, s in enumerate(specs):
        if s.padding:
            assert not out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].any()
        else:
            assert out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].isfinite().all()


@pytest.mark.parametrize("cuts", [[40], [7, 33], [12, 1, 1, 26], [1] * 40])
def test_chunked_over_the_cache_equals_one_pass(cuts: list[int]) -> None:
    """A sequence stepped in pieces (each reading the raw keys, K and V its earlier pieces left in the blocks)
    answers as one whole pass: what a prefix-cache hit restores is all the selection reads."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(DI, generator=gen) * 0.1, _tokens(gen, 40)
    blocks = list(range(1, 11))
    whole = _attend(x, _caches(0.0), _meta([SeqSpec([0] * 40, 0, blocks)]), w)
    caches, done, pieces = _caches(0.0), 0, []
    for n in cuts:
        meta = _meta([SeqSpec([0] * n, context_len=done, block_ids=blocks)])
        pieces.append(_attend([t[done : done + n] for t in x], caches, meta, w))
        done += n
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
