"""Sliding-window paged attention: fast vs reference vs a whole-sequence oracle, on tables whose blocks out
of the window are the null block (as the window group leaves them) holding NaN, in mixed batches of
prefill chunks and decodes, GQA, odd lengths and windows that straddle blocks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.paged_attention import paged_attention, paged_attention_ref

BLOCK = 4
NUM_BLOCKS = 96
HKV, DH = 2, 8


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Oracle: [L, Hq, Dh] attention of a whole sequence where position p sees p - window + 1 .. p."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(q.shape[0])
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _nulled(table: list[int], ctx: int, window: int) -> list[int]:
    """The table as the window group holds it at `ctx` computed tokens: blocks out of the window -> 0."""
    out_of_window = max(0, (ctx - window + 1) // BLOCK)
    return [0] * out_of_window + table[out_of_window:]


class Sequence:
    def __init__(self, gen: torch.Generator, length: int, hq: int, blocks: list[int]) -> None:
        self.q = torch.randn(length, hq, DH, generator=gen)
        self.k = torch.randn(length, HKV, DH, generator=gen)
        self.v = torch.randn(length, HKV, DH, generator=gen)
        self.blocks = blocks


@pytest.mark.parametrize("seed", range(12))
def test_rows_in_steps_equal_the_windowed_oracle(seed: int) -> None:
    """Several sequences advance together in random chunks (decodes included) through their windows."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    window = rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 13])
    hq = HKV * rng.choice([1, 2, 3])
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.randint(1, 4)):
        length = rng.randint(1, 40)
        seqs.append(Sequence(gen, length, hq, [free.pop() for _ in range(-(-length // BLOCK))]))
    kc = torch.full((NUM_BLOCKS, BLOCK, HKV, DH), torch.nan)
    vc = torch.full((NUM_BLOCKS, BLOCK, HKV, DH), torch.nan)
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < s.q.shape[0] for d, s in zip(done, seqs)):
        rows = [i for i, s in enumerate(seqs) if done[i] < s.q.shape[0] and rng.random() < 0.8]
        if not rows:
            continue
        specs, parts = [], []
        for i in rows:
            s, ctx = seqs[i], done[i]
            n = rng.choice([1, 1, rng.randint(1, s.q.shape[0] - ctx)])
            n = min(n, s.q.shape[0] - ctx)
            specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=_nulled(s.blocks, ctx, window)))
            parts.append((i, ctx, ctx + n))
        meta = _meta(specs)
        q, k, v = (torch.cat([getattr(seqs[i], x)[a:b] for i, a, b in parts]) for x in "qkv")
        kr, vr = kc.clone(), vc.clone()
        out = paged_attention(q, k, v, kc, vc, meta, 0.3, sliding_window=window)
        ref = paged_attention_ref(q, k, v, kr, vr, meta, 0.3, sliding_window=window)
        assert out.isfinite().all(), "a key out of the window (NaN) was read"
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kc, kr, rtol=0, atol=0, equal_nan=True)
        offset = 0
        for i, a, b in parts:
            outs[i].append(out[offset : offset + b - a])
            offset += b - a
            done[i] = b
        # What left the window may now hold anything: the next steps must not read it.
        for i, _, b in parts:
            for blk in seqs[i].blocks[: max(0, (b - window + 1) // BLOCK)]:
                kc[blk], vc[blk] = torch.nan, torch.nan
    assert torch.isnan(kc[0]).all(), "the null block was written"
    for s, o in zip(seqs, outs):
        torch.testing.assert_close(torch.cat(o), _windowed(s.q, s.k, s.v, 0.3, window), rtol=1e-5, atol=1e-5)


def test_window_wider_than_the_sequence_is_full_attention() -> None:
    gen = torch.Generator().manual_seed(5)
    s = Sequence(gen, 11, 4, [5, 9, 2])
    meta = _meta([SeqSpec(token_ids=[0] * 11, block_ids=s.blocks)])
    kc, vc = torch.zeros(NUM_BLOCKS, BLOCK, HKV, DH), torch.zeros(NUM_BLOCKS, BLOCK, HKV, DH)
    full = paged_attention(s.q, s.k, s.v, kc.clone(), vc.clone(), meta, 0.3)
    wide = paged_attention(s.q, s.k, s.v, kc, vc, meta, 0.3, sliding_window=64)
    torch.testing.assert_close(wide, full, rtol=0, atol=0)
