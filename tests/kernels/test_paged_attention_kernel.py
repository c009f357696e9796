"""Paged attention: fast vs reference on mixed batches, chunked prefill over a cached prefix vs full causal
attention, shuffled non-contiguous block tables, GQA, padding rows that read and write nothing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.paged_attention import paged_attention, paged_attention_ref, write_kv
from recap.kernels.paged_decode import paged_decode, paged_decode_available

BLOCK = 4
NUM_BLOCKS = 64
HKV, DH = 2, 8


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _caches(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, HKV, DH)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _qkv(gen: torch.Generator, t: int, hq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random new-token projections: q [t, hq, Dh], k and v [t, Hkv, Dh]."""
    return (
        torch.randn(t, hq, DH, generator=gen),
        torch.randn(t, HKV, DH, generator=gen),
        torch.randn(t, HKV, DH, generator=gen),
    )


def _full_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Independent oracle: [L, H, Dh] causal attention of a whole sequence, GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # (h, l, dh)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)


def _random_specs(rng: random.Random) -> list[SeqSpec]:
    """Prefill from scratch, prefill over a cached prefix, decode and padding rows, on shuffled blocks."""
    free = list(range(1, NUM_BLOCKS))  # block 0 is the null block
    rng.shuffle(free)
    specs = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["scratch", "prefix", "decode", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, 13)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, 30)
        need = -(-(ctx + n) // BLOCK)
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=[free.pop() for _ in range(need)]))
    return specs


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("seed", range(25))
def test_fast_matches_reference(seed: int, native: bool) -> None:
    """The fast path (its decode rows through torch or, native, kernels/paged_decode.py) against the reference."""
    if native and not paged_decode_available():
        pytest.skip("the native kernel cannot be built here")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    specs = _random_specs(rng)
    meta = _meta(specs)
    hq = HKV * rng.choice([1, 3])
    t = sum(len(s.token_ids) for s in specs)
    q, k, v = _qkv(gen, t, hq)
    kc, vc = _caches(gen)
    # NaN wherever no row may read: blocks no row owns (block 0 and the last block, which a -1 table
    # entry would reach, included) and positions past each row's seq_len inside its last block.
    own = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    for s in specs:
        for p in range(s.context_len + len(s.token_ids) if not s.padding else 0):
            own[s.block_ids[p // BLOCK] * BLOCK + p % BLOCK] = True
    for c in (kc, vc):
        c.view(-1, HKV, DH)[~own] = torch.nan
    kr, vr = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.35, native=native)
    ref = paged_attention_ref(q, k, v, kr, vr, meta, 0.35)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for c, c_ref in ((kc, kr), (vc, vr)):  # the same writes, bit for bit
        torch.testing.assert_close(c, c_ref, rtol=0, atol=0, equal_nan=True)
    for b in range(NUM_BLOCKS):  # blocks no row owns: untouched (the NaN is still there)
        if not own.view(NUM_BLOCKS, BLOCK)[b].any():
            assert kc[b].isnan().all() and vc[b].isnan().all()
    for r, s in enumerate(specs):
        if s.padding:
            start, end = meta.query_start_loc_list[r : r + 2]
            assert not out[start:end].any()


@pytest.mark.parametrize("seed", range(6))
def test_chunked_prefill_over_cached_prefix_equals_full_attention(seed: int) -> None:
    """Prefill one sequence in random chunks, each a separate step reading the earlier ones from the cache."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    length = rng.randint(2, 60)
    hq = HKV * 2
    q, k, v = _qkv(gen, length, hq)
    blocks = rng.sample(range(1, NUM_BLOCKS), -(-length // BLOCK))  # shuffled, non-contiguous
    kc, vc = _caches(gen)
    cuts = sorted(rng.sample(range(1, length), k=min(length - 1, rng.randint(1, 4))))
    outs = []
    for s, e in zip([0, *cuts], [*cuts, length]):
        meta = _meta([SeqSpec(token_ids=[0] * (e - s), context_len=s, block_ids=blocks)])
        outs.append(paged_attention(q[s:e], k[s:e], v[s:e], kc, vc, meta, 0.3))
    torch.testing.assert_close(torch.cat(outs), _full_causal(q, k, v, 0.3), rtol=1e-5, atol=1e-5)


def test_decode_batch_equals_full_attention() -> None:
    """An all-decode batch (the batched gather + mask path) with rows of different lengths and a padding row."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 5, 17, 9]
    hq = HKV * 4
    kc, vc = _caches(gen)
    seqs = [_qkv(gen, n, hq) for n in lengths]
    tables = [[1 + 8 * r + b for b in reversed(range(-(-n // BLOCK)))] for r, n in enumerate(lengths)]
    for (_, k, v), table, n in zip(seqs, tables, lengths):  # the prefixes are already cached
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - 1)], dtype=torch.long)
        write_kv(k[: n - 1], v[: n - 1], kc, vc, slots)
    specs = [SeqSpec(token_ids=[0], context_len=n - 1, block_ids=t) for n, t in zip(lengths, tables)]
    specs.insert(2, SeqSpec(token_ids=[0], padding=True))
    meta = _meta(specs)
    assert meta.is_decode
    last = [[x[-1:] for x in qkv] for qkv in seqs]
    last.insert(2, [torch.zeros_like(x) for x in last[0]])  # the padding row's token
    q, k, v = (torch.cat([row[i] for row in last]) for i in range(3))
    out = paged_attention(q, k, v, kc, vc, meta, 0.25)
    expected = [_full_causal(q_, k_, v_, 0.25)[-1] for q_, k_, v_ in seqs]
    torch.testing.assert_close(out[[0, 1, 3, 4]], torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert not out[2].any()


def test_write_kv_skips_padding_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    kc, vc = _caches(gen)
    kc0, vc0 = kc.clone(), vc.clone()
    k, v = torch.randn(3, HKV, DH, generator=gen), torch.randn(3, HKV, DH, generator=gen)
    write_kv(k, v, kc, vc, torch.tensor([9, -1, 4 * BLOCK + 2]))
    assert torch.equal(kc[2, 1], k[0]) and torch.equal(vc[4, 2], v[2])
    kc[2, 1], vc[2, 1], kc[4, 2], vc[4, 2] = kc0[2, 1], vc0[2, 1], kc0[4, 2], vc0[4, 2]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    meta = _meta(
        [
            SeqSpec(token_ids=[0] * 7, context_len=5, block_ids=[9, 2, 30]),
            SeqSpec(token_ids=[0], context_len=3, block_ids=[7]),
        ]
    )
    q, k, v = _qkv(gen, 8, 4)
    kc, vc = _caches(gen)
    ref = paged_attention_ref(q, k, v, kc.clone(), vc.clone(), meta, 0.3)
    kl, vl = kc.to(dtype), vc.to(dtype)
    out = paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), kl, vl, meta, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("seed", range(8))
def test_native_decode_rows_over_shuffled_blocks(seed: int, window: int | None) -> None:
    """Decode-only batches (the native kernel reads the batch's tables directly) with and without a sliding
    window, GQA, on shuffled blocks poisoned with NaN wherever no row may read: native vs the torch path."""
    if not paged_decode_available():
        pytest.skip("the native kernel cannot be built here")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    specs = []
    for _ in range(rng.randint(1, 5)):
        ctx = rng.randint(0, 30)
        specs.append(SeqSpec(token_ids=[0], context_len=ctx, block_ids=[free.pop() for _ in range(ctx // BLOCK + 1)]))
    meta = _meta(specs)
    hq = HKV * rng.choice([1, 2, 4])
    q, k, v = _qkv(gen, len(specs), hq)
    kc, vc = _caches(gen)
    own = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    for s in specs:
        for p in range(s.context_len + 1):
            own[s.block_ids[p // BLOCK] * BLOCK + p % BLOCK] = True
    for c in (kc, vc):
        c.view(-1, HKV, DH)[~own] = torch.nan
    kr, vr = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.4, window, native=True)
    ref = paged_attention(q, k, v, kr, vr, meta, 0.4, window, native=False)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kr, rtol=0, atol=0, equal_nan=True)


def test_native_decode_refuses_a_table_outside_the_cache() -> None:
    if not paged_decode_available():
        pytest.skip("the native kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)
    kc, vc = _caches(gen)
    q = torch.randn(1, HKV, DH, generator=gen)
    tables = torch.tensor([[3, NUM_BLOCKS]])  # the second block is past the pool
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode(q, kc, vc, tables, torch.tensor([BLOCK + 2]), 0.5)
    out = paged_decode(q, kc, vc, tables, torch.tensor([BLOCK]), 0.5)  # only the first block is read
    assert out.isfinite().all()
