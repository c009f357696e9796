"""Paged MLA: fast vs reference on mixed batches (prefill, prefill over a cached prefix, decode, padding) on
shuffled blocks with NaN wherever no row may read, and chunked steps vs whole-sequence attention over the
expanded K/V; only latents and rope keys are cached."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.mla import paged_mla_attention, paged_mla_attention_ref

BLOCK, NUM_BLOCKS = 4, 64
H, R, P, DN, DV = 3, 6, 4, 5, 7


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _inputs(gen: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(t, H, DN + P, generator=gen), torch.randn(t, R, generator=gen), torch.randn(t, P, generator=gen)


def _caches(fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((NUM_BLOCKS, BLOCK, 1, R), fill), torch.full((NUM_BLOCKS, BLOCK, 1, P), fill)


@pytest.mark.parametrize("seed", range(12))
def test_fast_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    w = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    specs, lat, rop = [], *_caches()
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["scratch", "prefix", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, 13)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, 30)
        blocks = [free.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        for p in range(ctx):  # the cached prefix: finite values where the row reads
            lat[blocks[p // BLOCK], p % BLOCK] = torch.randn(1, R, generator=gen)
            rop[blocks[p // BLOCK], p % BLOCK] = torch.randn(1, P, generator=gen)
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=blocks))
    meta = _meta(specs)
    q, c, kr = _inputs(gen, sum(len(s.token_ids) for s in specs))
    lat_ref, rop_ref = lat.clone(), rop.clone()
    out = paged_mla_attention(q, c, kr, lat, rop, meta, w, DN, 0.4)
    ref = paged_mla_attention_ref(q, c, kr, lat_ref, rop_ref, meta, w, DN, 0.4)
    assert out.shape == (q.shape[0], H, DV) and out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lat, lat_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(rop, rop_ref, rtol=0, atol=0, equal_nan=True)
    for r, s in enumerate(specs):
        if s.padding:
            assert not out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].any()


@pytest.mark.parametrize("seed", range(5))
def test_chunked_steps_equal_whole_sequence_attention(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    length = rng.randint(2, 45)
    w = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    q, c, kr = _inputs(gen, length)
    blocks = rng.sample(range(1, NUM_BLOCKS), -(-length // BLOCK))
    lat, rop = _caches(0.0)
    cuts = sorted(rng.sample(range(1, length), k=min(length - 1, rng.randint(1, 4))))
    outs = []
    for s, e in zip([0, *cuts], [*cuts, length]):
        meta = _meta([SeqSpec(token_ids=[0] * (e - s), context_len=s, block_ids=blocks)])
        outs.append(paged_mla_attention(q[s:e], c[s:e], kr[s:e], lat, rop, meta, w, DN, 0.4))
    kv = (c @ w.T).view(length, H, DN + DV)
    keys = torch.cat((kv[..., :DN], kr[:, None, :].expand(length, H, P)), dim=-1).transpose(0, 1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, kv[..., DN:].transpose(0, 1), is_causal=True, scale=0.4
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(lat[blocks[0], 0, 0], c[0]) and torch.equal(rop[blocks[0], 0, 0], kr[0])  # latents cached
