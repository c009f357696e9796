"""Triton paged MLA (absorbed form) against the torch reference: mixed batches (prefill, prefill over a cached
prefix, decode, padding) on shuffled blocks with NaN wherever no row may read, chunked steps against
whole-sequence attention over the expanded K/V, head counts above one head block, ranks that are not powers
of two; only latents and rope keys are cached, bit for bit as the reference writes them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.mla import paged_mla_attention_ref
from recap.kernels.triton.mla import paged_mla_attention

from .device_rows import DEVICE

BLOCK, NUM_BLOCKS = 4, 48
R, P, DN, DV = 6, 4, 5, 7


def _meta(specs: list[SeqSpec]) -> AttentionMetadata:
    """The step's paging on the test device (torch's default: build_forward_batch's device=None)."""
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _inputs(gen: torch.Generator, t: int, h: int, r: int = R) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(t, h, DN + P, generator=gen), torch.randn(t, r, generator=gen), torch.randn(t, P, generator=gen)


def _caches(r: int = R) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((NUM_BLOCKS, BLOCK, 1, r), torch.nan), torch.full((NUM_BLOCKS, BLOCK, 1, P), torch.nan)


def _random_rows(rng: random.Random, gen: torch.Generator, lat: torch.Tensor, rop: torch.Tensor) -> list[SeqSpec]:
    """Rows of every kind on shuffled blocks; the cached prefixes get finite latents, the rest stays NaN."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    specs = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["scratch", "prefix", "decode", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, 30)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, 40)
        blocks = [free.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        for p in range(ctx):
            lat[blocks[p // BLOCK], p % BLOCK] = torch.randn(1, lat.shape[-1], generator=gen)
            rop[blocks[p // BLOCK], p % BLOCK] = torch.randn(1, P, generator=gen)
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=blocks))
    return specs


@pytest.mark.parametrize("seed", range(12))
def test_mixed_batches_match_the_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    h, r = rng.choice([1, 3, 20]), rng.choice([6, 16])
    w = torch.randn(h * (DN + DV), r, generator=gen) * 0.3
    lat, rop = _caches(r)
    specs = _random_rows(rng, gen, lat, rop)
    meta = _meta(specs)
    q, c, kr = _inputs(gen, meta.query_start_loc_list[-1], h, r)
    lat_ref, rop_ref = lat.clone(), rop.clone()
    out = paged_mla_attention(q, c, kr, lat, rop, meta, w, DN, 0.4)
    ref = paged_mla_attention_ref(q, c, kr, lat_ref, rop_ref, meta, w, DN, 0.4)
    assert out.shape == (q.shape[0], h, DV) and out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(lat.nan_to_num(7.0), lat_ref.nan_to_num(7.0)) and lat[0].isnan().all()
    assert torch.equal(rop.nan_to_num(7.0), rop_ref.nan_to_num(7.0)) and rop[0].isnan().all()
    for row, s in enumerate(specs):
        if s.padding:
            assert not out[meta.query_start_loc_list[row] : meta.query_start_loc_list[row + 1]].any()


@pytest.mark.parametrize("seed", range(5))
def test_chunked_steps_equal_whole_sequence_attention(seed: int) -> None:
    """One sequence in random steps (decodes among them), each reading the earlier ones from the cache."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    length, h = rng.randint(2, 45), 3
    w = torch.randn(h * (DN + DV), R, generator=gen) * 0.3
    q, c, kr = _inputs(gen, length, h)
    blocks = rng.sample(range(1, NUM_BLOCKS), -(-length // BLOCK))
    lat, rop = _caches()
    cuts = sorted(rng.sample(range(1, length), k=min(length - 1, rng.randint(1, 6))))
    outs = []
    for s, e in zip([0, *cuts], [*cuts, length]):
        meta = _meta([SeqSpec(token_ids=[0] * (e - s), context_len=s, block_ids=blocks)])
        outs.append(paged_mla_attention(q[s:e], c[s:e], kr[s:e], lat, rop, meta, w, DN, 0.4))
    kv = (c @ w.T).view(length, h, DN + DV)
    keys = torch.cat((kv[..., :DN], kr[:, None, :].expand(length, h, P)), dim=-1).transpose(0, 1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, kv[..., DN:].transpose(0, 1), is_causal=True, scale=0.4
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(lat[blocks[0], 0, 0], c[0]) and torch.equal(rop[blocks[0], 0, 0], kr[0])  # latents cached


def test_a_tensor_on_another_device_is_named() -> None:
    """A cache off the queries' device is refused by name (the meta device stands for the CPU of a CUDA run)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    meta = _meta([SeqSpec(token_ids=[0] * 2, context_len=1, block_ids=[3])])
    q, c, kr = _inputs(gen, 2, 3)
    lat, rop = _caches()
    with pytest.raises(ValueError, match="rope_cache is on meta"):
        paged_mla_attention(q, c, kr, lat, rop.to("meta"), meta, torch.zeros(3 * (DN + DV), R), DN, 0.4)
    assert lat.isnan().all()  # refused before anything was written


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu(dtype: torch.dtype) -> None:
    """Every tensor on the GPU (metadata included), DeepSeek-like widths (rank 512, rope 64), fp32 and bf16,
    against the fp32 reference."""
    rng, gen = random.Random(1), torch.Generator(DEVICE).manual_seed(1)
    h, r = 16, 512
    w = torch.randn(h * (DN + DV), r, generator=gen) * 0.05
    lat, rop = _caches(r)
    specs = _random_rows(rng, gen, lat, rop)
    lat, rop = lat.nan_to_num(0.0), rop.nan_to_num(0.0)
    meta = _meta(specs)
    assert meta.block_tables.device.type == "cuda"
    q, c, kr = _inputs(gen, meta.query_start_loc_list[-1], h, r)
    ref = paged_mla_attention_ref(q, c, kr, lat.clone(), rop.clone(), meta, w, DN, 0.1)
    out = paged_mla_attention(*(x.to(dtype) for x in (q, c, kr, lat, rop)), meta, w.to(dtype), DN, 0.1)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
