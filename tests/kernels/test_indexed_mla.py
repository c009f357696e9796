"""Paged indexed (sparse) MLA: fast vs reference on mixed batches (prefill, prefill over a cached prefix,
decode, padding) on shuffled blocks with NaN wherever no row may read; chunked steps over the cache (the
indexer's keys and gates read back from the blocks a prefix left) vs one whole-sequence pass."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.dsa_indexer import IndexerShape, dsa_select
from recap.kernels.indexed_mla import paged_dsa_select, paged_sparse_mla_attention, paged_sparse_mla_attention_ref
from recap.kernels.metadata import AttentionMetadata, SeqSpec

BLOCK, NUM_BLOCKS = 4, 64
H, R, DN, DV, HI, DI = 3, 6, 5, 7, 4, 5
SHAPE = IndexerShape(topk=6, kpool=3, tail=True)


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _caches(fill: float) -> list[torch.Tensor]:
    return [torch.full((NUM_BLOCKS, BLOCK, 1, d), fill) for d in (R, DI, DI)]  # latent, index key, index gate


def _tokens(gen: torch.Generator, t: int) -> list[torch.Tensor]:
    sizes = ((t, H, DN), (t, R), (t, HI, DI), (t, HI), (t, DI), (t, DI))  # q, c, index q, w, index k, gate
    return [torch.randn(size, generator=gen) for size in sizes]


def _step(x: list[torch.Tensor], caches: list[torch.Tensor], meta: AttentionMetadata, w_kv_b: torch.Tensor,
          ape: torch.Tensor, fast: bool = True) -> tuple[torch.Tensor, list[torch.Tensor | None]]:  # fmt: skip
    q, c, iq, iw, ik, ig = x
    sel = paged_dsa_select(iq, iw, ik, ig, caches[1], caches[2], meta, ape, SHAPE)
    attend = paged_sparse_mla_attention if fast else paged_sparse_mla_attention_ref
    return attend(q, c, caches[0], meta, w_kv_b, DN, 0.4, sel), sel


@pytest.mark.parametrize("seed", range(10))
def test_fast_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    w, ape = torch.randn(H * (DN + DV), R, generator=gen) * 0.3, torch.randn(SHAPE.kpool, DI, generator=gen)
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
                cache[blocks[p // BLOCK], p % BLOCK] = torch.randn(1, cache.shape[-1], generator=gen)
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=blocks))
    meta = _meta(specs)
    x = _tokens(gen, sum(len(s.token_ids) for s in specs))
    ref_caches = [t.clone() for t in caches]
    out, sel = _step(x, caches, meta, w, ape)
    ref, _ = _step(x, ref_caches, meta, w, ape, fast=False)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for r, s in enumerate(specs):
        assert (sel[r] is None) == s.padding
        if s.padding:
            assert not out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].any()


def _dense(x: list[torch.Tensor], w_kv_b: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """The whole sequence at once, without the cache: selection, expanded K/V, masked softmax."""
    q, c, iq, iw, ik, ig = x
    sel = dsa_select(iq, iw, ik, ig, ape, 0, SHAPE)
    kv = (c @ w_kv_b.T).view(c.shape[0], H, DN + DV)
    logits = torch.einsum("nhd,shd->hns", q, kv[..., :DN]) * 0.4
    return torch.einsum("hns,shd->nhd", logits.masked_fill(~sel, -torch.inf).softmax(-1), kv[..., DN:])


@pytest.mark.parametrize("seed", range(5))
def test_chunked_steps_equal_whole_sequence(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    length = rng.randint(14, 45)
    w, ape = torch.randn(H * (DN + DV), R, generator=gen) * 0.3, torch.randn(SHAPE.kpool, DI, generator=gen)
    x = _tokens(gen, length)
    blocks = rng.sample(range(1, NUM_BLOCKS), -(-length // BLOCK))
    caches = _caches(0.0)
    cuts = sorted(rng.sample(range(1, length), k=min(length - 1, rng.randint(1, 4))))
    outs = []
    for s, e in zip([0, *cuts], [*cuts, length]):
        meta = _meta([SeqSpec(token_ids=[0] * (e - s), context_len=s, block_ids=blocks)])
        outs.append(_step([t[s:e] for t in x], caches, meta, w, ape)[0])
    torch.testing.assert_close(torch.cat(outs), _dense(x, w, ape), rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1][blocks[0], 1, 0], x[4][1])  # the indexer's keys are cached per token


def test_selection_shapes_are_checked() -> None:
    meta = _meta([SeqSpec(token_ids=[0] * 3, context_len=0, block_ids=[1])])
    q, c = torch.randn(3, H, DN), torch.randn(3, R)
    with pytest.raises(ValueError, match="selection"):
        paged_sparse_mla_attention(q, c, _caches(0.0)[0], meta, torch.randn(H * (DN + DV), R), DN, 0.4,
                                   [torch.ones(3, 4, dtype=torch.bool)])  # fmt: skip
