"""Paged attention with a per-query relative bias (Inkling) vs its plain whole-sequence twin: several sequences
advance together in random chunks (decodes included), GQA, windows that straddle blocks, bias extents shorter
and longer than the sequences; blocks out of the window are the null block holding NaN."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.rel_bias_attention import paged_rel_bias_attention, rel_bias_attention_ref

BLOCK = 4
NUM_BLOCKS = 64
HKV, DH = 2, 8


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _nulled(table: list[int], ctx: int, window: int | None) -> list[int]:
    """The table as the window group holds it at `ctx` computed tokens: blocks out of the window -> 0."""
    if window is None:
        return table
    out = max(0, (ctx - window + 1) // BLOCK)
    return [0] * out + table[out:]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("sinks", [False, True])
def test_paged_rows_in_steps_equal_the_reference(seed: int, sinks: bool) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    window = rng.choice([None, None, 3, 5, 9])
    extent = rng.choice([1, 4, 7, 64])
    hq = HKV * rng.choice([1, 2])
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 30)
        x = [torch.randn(n, h, DH, generator=gen) for h in (hq, HKV, HKV)] + [torch.randn(n, hq, extent, generator=gen)]
        x.append(torch.randn(n, hq, generator=gen) if sinks else None)
        seqs.append((x, [free.pop() for _ in range(-(-n // BLOCK))]))
    kc = torch.full((NUM_BLOCKS, BLOCK, HKV, DH), torch.nan)
    vc = kc.clone()
    done, outs = [0] * len(seqs), [[] for _ in seqs]  # type: ignore[var-annotated]
    while any(d < s[0][0].shape[0] for d, s in zip(done, seqs)):
        parts = []
        for i, (x, _) in enumerate(seqs):
            left = x[0].shape[0] - done[i]
            if left and rng.random() < 0.8:
                parts.append((i, done[i], done[i] + min(left, rng.choice([1, 1, rng.randint(1, left)]))))
        if not parts:
            continue
        specs = [SeqSpec([0] * (b - a), a, _nulled(seqs[i][1], a, window)) for i, a, b in parts]
        q, k, v, rel = (torch.cat([seqs[i][0][j][a:b] for i, a, b in parts]) for j in range(4))
        sink = torch.cat([seqs[i][0][4][a:b] for i, a, b in parts]) if sinks else None
        out = paged_rel_bias_attention(q, k, v, rel, kc, vc, _meta(specs), 0.3, window, sink)
        assert out.isfinite().all(), "a key out of the window (NaN) was read"
        offset = 0
        for i, a, b in parts:
            outs[i].append(out[offset : offset + b - a])
            offset, done[i] = offset + b - a, b
        for i, _, b in parts:  # what left the window may now hold anything
            for blk in seqs[i][1][: max(0, (b - window + 1) // BLOCK) if window else 0]:
                kc[blk], vc[blk] = torch.nan, torch.nan
    for (x, _), o in zip(seqs, outs):
        want = rel_bias_attention_ref(*x[:4], 0.3, window, x[4])
        torch.testing.assert_close(torch.cat(o), want, rtol=1e-5, atol=1e-5)


def test_a_sink_takes_probability_mass() -> None:
    """A sink logit s adds exp(s) to every softmax denominator: outputs shrink by sum / (sum + exp(s))."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 1, DH, generator=gen), torch.randn(1, 1, DH, generator=gen), torch.randn(1, 1, DH)
    rel = torch.zeros(1, 1, 2)
    plain = rel_bias_attention_ref(q, k, v, rel, 0.5)
    sunk = rel_bias_attention_ref(q, k, v, rel, 0.5, sinks=torch.zeros(1, 1))
    logit = float(q[0, 0] @ k[0, 0]) * 0.5
    w = torch.tensor(logit).exp() / (torch.tensor(logit).exp() + 1.0)
    torch.testing.assert_close(sunk, plain * w, rtol=1e-5, atol=1e-6)


def test_zero_bias_is_plain_causal_attention() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(9, 4, DH, generator=gen), torch.randn(9, 2, DH, generator=gen), torch.randn(9, 2, DH)
    got = rel_bias_attention_ref(q, k, v, torch.zeros(9, 4, 5), 0.5)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True, scale=0.5
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
