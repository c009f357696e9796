"""Triton paged attention against the torch reference: mixed batches (prefill from scratch, over a cached
prefix, decode, padding rows), chunked prefill and decode steps against a whole-sequence oracle, GQA, head
dims that are not powers of two, sliding windows narrower and wider than the rows, shuffled non-contiguous
blocks and window tables whose out-of-window entries are the null block. Every position no row may read
holds NaN, so a stray read shows as a non-finite output; the caches must match the reference's bit for bit
and block 0 must stay untouched."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.paged_attention import paged_attention_ref
from recap.kernels.triton import paged_attention as pa
from recap.kernels.triton.paged_attention import HD256_PREFILL_TILES, attend, paged_attention, write_kv

from .device_rows import DEVICE
from .hopper import compile_for_hopper

HKV, NUM_BLOCKS = 2, 48


def _meta(specs: list[SeqSpec], block: int) -> AttentionMetadata:
    """The step's paging on the test device (torch's default: build_forward_batch's device=None)."""
    fb = build_forward_batch(specs, block_size=block, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None
    return fb.attn


def _nan_caches(block: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, block, HKV, dh)
    return torch.full(shape, torch.nan), torch.full(shape, torch.nan)


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """[L, Hq, Dh] attention of a whole sequence: position p sees p - window + 1 .. p (0 .. p without one)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(q.shape[0], device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _visible_from(ctx: int, window: int | None) -> int:
    """The first key position a row at `ctx` computed tokens may read (its first query's window)."""
    return 0 if window is None else max(0, ctx - window + 1)


def _random_batch(
    rng: random.Random, gen: torch.Generator, block: int, dh: int, hq: int, window: int | None
) -> tuple[list[SeqSpec], torch.Tensor, torch.Tensor]:
    """Rows of every kind on shuffled blocks, and caches holding finite values only where a row may read
    (its cached prefix inside the window); out-of-window table entries are the null block 0."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    kc, vc = _nan_caches(block, dh)
    specs = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["scratch", "prefix", "decode", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, 40)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, 45)
        table = [free.pop() for _ in range(-(-(ctx + n) // block))]
        lo = _visible_from(ctx, window)
        for p in range(lo, ctx):
            for c in (kc, vc):
                c[table[p // block], p % block] = torch.randn(HKV, dh, generator=gen)
        table = [0] * (lo // block) + table[lo // block :]
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=table))
    return specs, kc, vc


@pytest.mark.parametrize("seed", range(16))
def test_mixed_batches_match_the_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    block = rng.choice([4, 16])
    dh = rng.choice([8, 20, 32])
    hq = HKV * rng.choice([1, 2, 3, 4, 20])  # 20: two head blocks per kv head
    window = rng.choice([None, None, 1, 3, 6, 17, 100])
    specs, kc, vc = _random_batch(rng, gen, block, dh, hq, window)
    meta = _meta(specs, block)
    t = meta.query_start_loc_list[-1]
    q, k, v = (torch.randn(t, h, dh, generator=gen) for h in (hq, HKV, HKV))
    kr, vr = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.35, window)
    ref = paged_attention_ref(q, k, v, kr, vr, meta, 0.35, window)
    assert out.isfinite().all(), "a position no row may read (NaN) was read"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for c, c_ref in ((kc, kr), (vc, vr)):  # the same writes, bit for bit; the null block untouched
        assert torch.equal(c.nan_to_num(7.0), c_ref.nan_to_num(7.0))
        assert c[0].isnan().all()
    for r, s in enumerate(specs):
        if s.padding:
            assert not out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].any()


@pytest.mark.parametrize(("seed", "tiles"), [(0, HD256_PREFILL_TILES), (1, HD256_PREFILL_TILES), (2, (64, 16, 4))])
def test_prefill_tiles_match_the_reference(seed: int, tiles: tuple[int, int, int]) -> None:
    """The prefill tiles chosen for 16-bit head_dim-256 queries (128 rows: up to 128 queries of one head per
    tile) and another tiling, here in fp32 at small head dims: the tiling changes no result but rounding."""
    rng, gen = random.Random(300 + seed), torch.Generator(DEVICE).manual_seed(seed)
    block, dh, hq = rng.choice([4, 16]), 16, HKV * rng.choice([1, 3, 8])
    specs, kc, vc = _random_batch(rng, gen, block, dh, hq, None)
    specs = [s for s in specs if len(s.token_ids) > 1] or [SeqSpec(token_ids=[0] * 9, block_ids=[1, 2, 3])]
    meta = _meta(specs, block)
    t = meta.query_start_loc_list[-1]
    q = torch.randn(t, hq, dh, generator=gen)
    ref = paged_attention_ref(q, torch.zeros(t, HKV, dh), torch.zeros(t, HKV, dh), kc.clone(), vc.clone(), meta, 0.4)
    write_kv(torch.zeros(t, HKV, dh), torch.zeros(t, HKV, dh), kc, vc, meta.slot_mapping)
    out = torch.empty_like(q)
    attend(q, kc, vc, out, meta, 0.4, tiles=tiles)
    assert not meta.is_decode
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("seed", "splits"), [(0, 2), (1, 4), (2, 8), (3, 32), (4, 4), (5, 2)])
def test_prefill_key_splits_match_the_reference(seed: int, splits: int) -> None:
    """Prefill and mixed steps split over their keys (each split a share of its tile's key tiles, the partial
    softmaxes merged): the reference's result up to rounding, whatever the count, with windows, padding rows
    (zeros) and splits left empty (32 splits of rows of a few key tiles)."""
    rng, gen = random.Random(400 + seed), torch.Generator(DEVICE).manual_seed(seed)
    block, dh, hq = rng.choice([4, 16]), rng.choice([8, 20]), HKV * rng.choice([1, 3, 8])
    window = rng.choice([None, None, 3, 17])
    specs, kc, vc = _random_batch(rng, gen, block, dh, hq, window)
    if all(len(s.token_ids) == 1 for s in specs):  # keep it a prefill step: a row from scratch on spare blocks
        used = {b for s in specs for b in s.block_ids}
        spare = [b for b in range(1, NUM_BLOCKS) if b not in used]
        specs.append(SeqSpec(token_ids=[0] * 5, block_ids=spare[: -(-5 // block)]))
    meta = _meta(specs, block)
    assert not meta.is_decode
    t = meta.query_start_loc_list[-1]
    q, k, v = (torch.randn(t, h, dh, generator=gen) for h in (hq, HKV, HKV))
    ref = paged_attention_ref(q, k, v, kc.clone(), vc.clone(), meta, 0.3, window)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = torch.full_like(q, torch.nan)
    attend(q, kc, vc, out, meta, 0.3, window, splits=splits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for r, s in enumerate(specs):
        if s.padding:
            assert not out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]].any()


def test_a_few_tokens_over_a_long_prefix_split_their_keys() -> None:
    """A cached prefix + a few new tokens (few programs, many keys) splits its keys; a long prefill, whose
    programs fill the card, does not; the partial softmaxes stay within their byte budget."""
    block, hq, dh = 16, 16, 128
    cached = build_forward_batch(
        [SeqSpec(token_ids=[0] * 64, context_len=8192, block_ids=list(range(1, 518)))],
        block_size=block,
        chunk_size=16,
        with_attention=True,
        with_ssm=False,
    ).attn
    cold = build_forward_batch(
        [SeqSpec(token_ids=[0] * 8192, block_ids=list(range(1, 513)))],
        block_size=block,
        chunk_size=16,
        with_attention=True,
        with_ssm=False,
    ).attn
    assert cached is not None and cold is not None
    heads, block_q, *_ = pa._tiles(hq // HKV, dh, False)
    programs = (64 // block_q + 1) * HKV * triton.cdiv(hq // HKV, heads)  # 18
    assert programs < 132 and pa._splits(cached, programs, 64, hq, dh) == 16  # 8256 keys / 1024; 264 / 18
    assert pa._splits(cold, (8192 // block_q + 1) * HKV, 8192, hq, dh) == 1
    few = pa._splits(cached, 1, 4096, hq, dh)  # 16 by the work, fewer by the budget of 4096 tokens' partials
    assert few == 2 and 4096 * hq * few * dh * 4 <= pa.SPLIT_PARTIAL_BYTES


@pytest.mark.parametrize("seed", range(8))
def test_steps_equal_whole_sequence_attention(seed: int) -> None:
    """Sequences advance together in random steps (prefill chunks over their cached prefix, decodes); the
    window group's tables null what left the window, and what left it is poisoned before the next step."""
    rng, gen = random.Random(100 + seed), torch.Generator(DEVICE).manual_seed(seed)
    block, dh = rng.choice([4, 16]), rng.choice([16, 24])
    hq = HKV * rng.choice([1, 2, 4])
    window = rng.choice([None, 2, 5, 9, 64])
    lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 3))]
    blocks = rng.sample(range(1, NUM_BLOCKS), sum(-(-n // block) for n in lengths))
    tables = []
    for n in lengths:
        tables.append(blocks[: -(-n // block)])
        blocks = blocks[-(-n // block) :]
    seqs = [[torch.randn(n, h, dh, generator=gen) for h in (hq, HKV, HKV)] for n in lengths]
    kc, vc = _nan_caches(block, dh)
    done, outs = [0] * len(lengths), [[] for _ in lengths]
    while any(d < n for d, n in zip(done, lengths)):
        rows = [i for i, n in enumerate(lengths) if done[i] < n]
        steps = [min(lengths[i] - done[i], rng.choice([1, 1, rng.randint(1, 20)])) for i in rows]
        specs = []
        for i, n in zip(rows, steps):
            lo = _visible_from(done[i], window) // block
            specs.append(SeqSpec(token_ids=[0] * n, context_len=done[i], block_ids=[0] * lo + tables[i][lo:]))
        meta = _meta(specs, block)
        q, k, v = (torch.cat([seqs[i][x][done[i] : done[i] + n] for i, n in zip(rows, steps)]) for x in range(3))
        out = paged_attention(q, k, v, kc, vc, meta, 0.3, window)
        assert out.isfinite().all()
        for r, (i, n) in enumerate(zip(rows, steps)):
            outs[i].append(out[meta.query_start_loc_list[r] : meta.query_start_loc_list[r + 1]])
            done[i] += n
            for b in tables[i][: _visible_from(done[i], window) // block]:  # out of the window from now on
                kc[b], vc[b] = torch.nan, torch.nan
    assert kc[0].isnan().all() and vc[0].isnan().all()
    for (q, k, v), o in zip(seqs, outs):
        torch.testing.assert_close(torch.cat(o), _oracle(q, k, v, 0.3, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_decode_batch_with_gqa_and_a_padding_row(window: int | None, splits: int | None) -> None:
    """An all-decode batch (one program per row, kv head and key split) with a non-power-of-two group and
    head dim; 4 splits of the longest row leave one split empty (and, windowed, two or three)."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    block, dh, hq, num_blocks = 16, 20, HKV * 3, 128
    lengths = [1, 5, 17, 33, 300]
    seqs = [[torch.randn(n, h, dh, generator=gen) for h in (hq, HKV, HKV)] for n in lengths]
    tables = [[1 + 20 * r + b for b in reversed(range(-(-n // block)))] for r, n in enumerate(lengths)]
    kc, vc = torch.full((num_blocks, block, HKV, dh), torch.nan), torch.full((num_blocks, block, HKV, dh), torch.nan)
    for (_, k, v), table, n in zip(seqs, tables, lengths):  # the prefixes are already cached
        slots = torch.tensor([table[p // block] * block + p % block for p in range(n - 1)], dtype=torch.long)
        write_kv(k[: n - 1], v[: n - 1], kc, vc, slots)
    specs = [SeqSpec(token_ids=[0], context_len=n - 1, block_ids=t) for n, t in zip(lengths, tables)]
    specs.insert(2, SeqSpec(token_ids=[0], padding=True))
    meta = _meta(specs, block)
    assert meta.is_decode
    last = [[x[-1:] for x in s] for s in seqs]
    last.insert(2, [torch.full_like(x, torch.nan) for x in last[0]])  # the padding row's token: never read
    q, k, v = (torch.cat([row[i] for row in last]) for i in range(3))
    if splits is None:
        out = paged_attention(q, k, v, kc, vc, meta, 0.25, window)
    else:
        write_kv(k, v, kc, vc, meta.slot_mapping)
        out = torch.full_like(q, torch.nan)
        attend(q, kc, vc, out, meta, 0.25, window, splits=splits)
    expected = torch.stack([_oracle(*s, 0.25, window)[-1] for s in seqs])
    torch.testing.assert_close(out[[0, 1, 3, 4, 5]], expected, rtol=1e-5, atol=1e-5)
    assert not out[2].any()


def test_write_kv_skips_padding_slots_and_casts() -> None:
    gen = torch.Generator(DEVICE).manual_seed(1)
    kc, vc = torch.randn(8, 4, HKV, 20, generator=gen), torch.randn(8, 4, HKV, 20, generator=gen)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    kc0, vc0 = kc.clone(), vc.clone()
    k = torch.randn(3, 2 * HKV, 20, generator=gen)[:, ::2]  # a strided view
    v = torch.randn(3, HKV, 20, generator=gen)
    write_kv(k, v, kc, vc, torch.tensor([9, -1, 4 * 4 + 2]))
    assert torch.equal(kc[2, 1], k[0].bfloat16()) and torch.equal(vc[4, 2], v[2].bfloat16())
    kc[2, 1], vc[2, 1], kc[4, 2], vc[4, 2] = kc0[2, 1], vc0[2, 1], kc0[4, 2], vc0[4, 2]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_fp32_queries_over_a_bf16_cache() -> None:
    """Queries in fp32 over a bf16 cache: both read as fp32, as the reference does."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    specs = [SeqSpec(token_ids=[0] * 7, context_len=5, block_ids=[9, 2, 30]), SeqSpec(token_ids=[0], block_ids=[7])]
    meta = _meta(specs, 4)
    q, k, v = (torch.randn(8, h, 24, generator=gen) for h in (4, HKV, HKV))
    kc = torch.randn(NUM_BLOCKS, 4, HKV, 24, generator=gen).bfloat16()
    vc = torch.randn(NUM_BLOCKS, 4, HKV, 24, generator=gen).bfloat16()
    kr, vr = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.3)
    ref = paged_attention_ref(q, k, v, kr, vr, meta, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_a_tensor_on_another_device_is_named() -> None:
    """A tensor off the kernel's device is refused by name (Triton's own error names an argument index only);
    the meta device stands for the CPU of a CUDA run."""
    meta = _meta([SeqSpec(token_ids=[0] * 3, context_len=2, block_ids=[5, 6])], 4)
    q, k, v = (torch.zeros(3, HKV, 8) for _ in range(3))
    kc, vc = _nan_caches(4, 8)
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        paged_attention(q, k, v, kc, vc, dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to("meta")), 0.3)
    with pytest.raises(ValueError, match="v_cache is on meta"):
        paged_attention(q, k, v, kc, vc.to("meta"), meta, 0.3)
    tables_elsewhere = dataclasses.replace(meta, block_tables=meta.block_tables.to("meta"))
    with pytest.raises(ValueError, match="block_tables is on meta"):
        attend(q, kc, vc, torch.empty_like(q), tables_elsewhere, 0.3)
    assert kc.isnan().all() and vc.isnan().all()  # refused before anything was written


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu(dtype: torch.dtype) -> None:
    """Every tensor on the GPU (metadata included), in fp32 and bf16, against the fp32 reference."""
    rng, gen = random.Random(0), torch.Generator(DEVICE).manual_seed(0)
    specs, kc, vc = _random_batch(rng, gen, 16, 80, HKV * 4, None)
    meta = _meta(specs, 16)
    assert meta.block_tables.device.type == "cuda"
    t = meta.query_start_loc_list[-1]
    q, k, v = (torch.randn(t, h, 80, generator=gen) for h in (HKV * 4, HKV, HKV))
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    ref = paged_attention_ref(q, k, v, kc.clone(), vc.clone(), meta, 0.1)
    out = paged_attention(*(x.to(dtype) for x in (q, k, v, kc, vc)), meta, 0.1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def compile_case(case: str) -> None:
    """Compile the kernels as the host launches them for `case` (bf16, tiles from _tiles) and check that
    the attention kernel's K/V loads are pipelined (cp.async) and its prefill dots (not MLA's) use wgmma. Needs triton
    imported with TRITON_INTERPRET=0 (its own jit helpers are decorated at import)."""
    mla, decode, split = case.startswith("mla"), case.startswith("decode"), case.endswith("splits")
    group, dh = (16, 512) if mla else (4, 80)
    block_d = triton.next_power_of_2(dh)
    heads, block_q, block_m, block_n, warps = pa._tiles(group, block_d, decode)
    pointers = {n: "*bf16" for n in ("q_ptr", "q2_ptr", "k_ptr", "v_ptr", "r_ptr", "o_ptr")}
    pointers |= {"tables_ptr": "*i64", "ctx_ptr": "*i64", "qsl_ptr": "*i64", "part_ptr": "*fp32", "ml_ptr": "*fp32"}
    consts = dict(GROUP=group, HEADS=heads, HEAD_DIM=dh, BLOCK_D=block_d, ROPE_DIM=64 if mla else 0, BLOCK_R=64,
                  BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, DECODE=decode,
                  USE_WINDOW=case.endswith("window"), V_IS_K=mla, UPCAST=False, PRECISION="tf32",
                  SPLITS=8 if split else 1)  # fmt: skip
    ptx = compile_for_hopper(pa._attention_kernel, pointers, consts, warps, floats=("qk_scale",))
    assert "cp.async" in ptx and (decode or mla or "wgmma" in ptx), case  # MLA's 32-row tiles: mma.sync
    if split:
        merge = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16"}
        compile_for_hopper(pa._merge_splits_kernel, merge, dict(HEAD_DIM=dh, BLOCK_D=block_d, SPLITS=8))
    if not decode:
        store = {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64"}
        dims = dict(HK=1, DK=dh, HV=1, DV=64, BLOCK_HK=1, BLOCK_DK=block_d, BLOCK_HV=1, BLOCK_DV=64)
        compile_for_hopper(pa._store_kv_kernel, store, dims)


def test_kernels_compile_for_hopper() -> None:
    """What only the compiler refuses (the interpreter runs any Python) fails here, without a GPU: the
    kernels compile for sm_90 through ptxas, in a fresh process with the interpreter off."""
    cases = ["prefill_window", "decode_splits", "mla_prefill", "prefill_splits"]
    code = f"from tests.kernels.triton.test_paged_attention import compile_case\nfor c in {cases}: compile_case(c)"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
