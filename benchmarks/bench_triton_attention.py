"""Triton paged attention and paged MLA on a GPU: the compiled kernels against the torch references, then speed.

    python benchmarks/bench_triton_attention.py [--out bench_out/bench_triton_attention.json] [--tiny]

1. Correctness: random mixed batches (prefill from scratch, over a cached prefix, decodes, padding rows) on
   shuffled blocks, positions no row may read poisoned with NaN, GQA groups 1-8, head dims 64/80/128,
   sliding windows; fp32 and bf16 on the device against the fp32 reference on the CPU (max abs error).
2. Speed (bf16, block 16): prefill of one 8k-token row and of 512 tokens over a cached 8k prefix (TFLOP/s,
   with torch's causal SDPA on the same 8k row beside it), decode at batch 1/32/128 over 8k-token
   contexts (GB/s of K/V read), and MLA (rank 512, rope 64, 16 heads) decode and prefill.
--tiny: small shapes, for a dry run on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from recap.bench.timing import cuda_median_ms
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, SeqSpec
from recap.kernels.mla import paged_mla_attention_ref
from recap.kernels.paged_attention import paged_attention_ref
from recap.kernels.triton.mla import paged_mla_attention
from recap.kernels.triton.paged_attention import paged_attention

BLOCK = 16


def _meta(specs: list[SeqSpec], device: str) -> AttentionMetadata:
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=64, with_attention=True, with_ssm=False, device=device)
    assert fb.attn is not None
    return fb.attn


def _random_specs(rng: random.Random, num_blocks: int, max_len: int, window: int | None) -> list[SeqSpec]:
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    specs = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["scratch", "prefix", "decode", "decode", "padding"])
        n = 1 if kind == "decode" else rng.randint(1, max_len)
        if kind == "padding":
            specs.append(SeqSpec(token_ids=[0] * n, padding=True))
            continue
        ctx = 0 if kind == "scratch" else rng.randint(1, max_len)
        table = [free.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        lo = 0 if window is None else max(0, ctx - window + 1) // BLOCK
        specs.append(SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=[0] * lo + table[lo:]))
    return specs


def _poisoned(specs: list[SeqSpec], shape: tuple[int, ...], gen: torch.Generator, window: int | None) -> torch.Tensor:
    """A cache with random values where some row's cached prefix (inside its window) lies, NaN elsewhere."""
    cache = torch.full(shape, torch.nan)
    for s in specs:
        lo = 0 if window is None else max(0, s.context_len - window + 1)
        for p in range(lo, s.context_len):
            cache[s.block_ids[p // BLOCK], p % BLOCK] = torch.randn(shape[2:], generator=gen)
    return cache


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float().cpu() - ref).abs().max()) if out.isfinite().all() else float("inf")


def check_attention(dev: str, cases: int, max_len: int) -> list[dict]:
    rows = []
    for seed in range(cases):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        hkv, dh, group = rng.choice([1, 2, 4]), rng.choice([64, 80, 128]), rng.choice([1, 2, 4, 8])
        window = rng.choice([None, None, 37, 200])
        specs = _random_specs(rng, 512, max_len, window)
        meta, meta_dev = _meta(specs, "cpu"), _meta(specs, dev)
        t = meta.query_start_loc_list[-1]
        q, k, v = (torch.randn(t, h, dh, generator=gen) for h in (hkv * group, hkv, hkv))
        kc, vc = (_poisoned(specs, (512, BLOCK, hkv, dh), gen, window) for _ in range(2))
        ref = paged_attention_ref(q, k, v, kc.clone(), vc.clone(), meta, dh**-0.5, window)
        for dtype in (torch.float32, torch.bfloat16):
            args = [x.to(dev, dtype) for x in (q, k, v, kc, vc)]
            out = paged_attention(*args[:5], meta_dev, dh**-0.5, window)
            rows.append({"kernel": "attention", "seed": seed, "dtype": str(dtype)[6:], "hkv": hkv, "group": group,
                         "dh": dh, "window": window, "tokens": t, "max_err": _err(out, ref)})  # fmt: skip
    return rows


def check_mla(dev: str, cases: int, max_len: int) -> list[dict]:
    rows = []
    h, r, p, dn, dv = 16, 512, 64, 128, 128
    for seed in range(cases):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        specs = _random_specs(rng, 256, max_len, None)
        meta, meta_dev = _meta(specs, "cpu"), _meta(specs, dev)
        t = meta.query_start_loc_list[-1]
        q = torch.randn(t, h, dn + p, generator=gen)
        c, kr = torch.randn(t, r, generator=gen), torch.randn(t, p, generator=gen)
        w = torch.randn(h * (dn + dv), r, generator=gen) * r**-0.5
        lat, rop = _poisoned(specs, (256, BLOCK, 1, r), gen, None), _poisoned(specs, (256, BLOCK, 1, p), gen, None)
        scale = (dn + p) ** -0.5
        ref = paged_mla_attention_ref(q, c, kr, lat.clone(), rop.clone(), meta, w, dn, scale)
        for dtype in (torch.float32, torch.bfloat16):
            args = [x.to(dev, dtype) for x in (q, c, kr, lat, rop)]
            out = paged_mla_attention(*args, meta_dev, w.to(dev, dtype), dn, scale)
            rows.append({"kernel": "mla", "seed": seed, "dtype": str(dtype)[6:], "tokens": t,
                         "max_err": _err(out, ref)})  # fmt: skip
    return rows


def _time_ms(fn: Callable[[], object], dev: str, reps: int) -> float:
    """CUDA-event median on a GPU; NaN elsewhere (the interpreter's timings mean nothing)."""
    return cuda_median_ms(fn, reps) if dev == "cuda" else float("nan")


def _row_specs(ctx_lens: list[int], new: int) -> list[SeqSpec]:
    specs, nxt = [], 1
    for ctx in ctx_lens:
        need = -(-(ctx + new) // BLOCK)
        specs.append(SeqSpec(token_ids=[0] * new, context_len=ctx, block_ids=list(range(nxt, nxt + need))[::-1]))
        nxt += need
    return specs


def speed(dev: str, size: int, reps: int) -> list[dict]:
    dt, hq, hkv, dh = torch.bfloat16, 32, 8, 128
    rows = []

    def attn(label: str, ctx_lens: list[int], new: int) -> None:
        specs = _row_specs(ctx_lens, new)
        meta = _meta(specs, dev)
        nb = 1 + sum(len(s.block_ids) for s in specs)
        t = len(ctx_lens) * new
        q, k, v = (torch.randn(t, h, dh, device=dev, dtype=dt) for h in (hq, hkv, hkv))
        kc, vc = (torch.randn(nb, BLOCK, hkv, dh, device=dev, dtype=dt) for _ in range(2))
        ms = _time_ms(lambda: paged_attention(q, k, v, kc, vc, meta, dh**-0.5), dev, reps)
        pairs = sum((c + 1 + c + new) * new / 2 for c in ctx_lens)  # (query, visible key) pairs
        kv_bytes = sum(c + new for c in ctx_lens) * hkv * dh * 2 * kc.element_size()
        rows.append({"case": label, "ms": ms, "TFLOP/s": 4 * pairs * hq * dh / ms / 1e9, "GB/s": kv_bytes / ms / 1e6})

    attn(f"prefill {size} tokens", [0], size)
    attn(f"prefill 512 over {size} cached", [size], 512)
    for b in (1, 32, 128):
        attn(f"decode batch {b}, ctx {size}", [size] * b, 1)
    q = torch.randn(1, hq, size, dh, device=dev, dtype=dt)
    k = torch.randn(1, hkv, size, dh, device=dev, dtype=dt).repeat_interleave(hq // hkv, 1)
    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True), dev, reps)
    rows.append({"case": f"torch SDPA causal {size} (GQA expanded)", "ms": ms,
                 "TFLOP/s": 2 * size * size * hq * dh / ms / 1e9, "GB/s": float("nan")})  # fmt: skip
    rows += _mla_speed(dev, size, reps)
    return rows


def _mla_case(dev: str, label: str, ctx_lens: list[int], new: int, reps: int) -> dict:
    """One MLA timing (rank 512, rope 64, 16 heads of 128 + 64, bf16): latent bytes read, FLOPs of the
    absorbed form (scores over rank + rope, values over rank)."""
    dt, h, r, p, dn, dv = torch.bfloat16, 16, 512, 64, 128, 128
    meta = _meta(_row_specs(ctx_lens, new), dev)
    nb = 2 + int(meta.block_tables.max())
    t = len(ctx_lens) * new
    q = torch.randn(t, h, dn + p, device=dev, dtype=dt)
    c, kr = torch.randn(t, r, device=dev, dtype=dt), torch.randn(t, p, device=dev, dtype=dt)
    lat = torch.randn(nb, BLOCK, 1, r, device=dev, dtype=dt)
    rop = torch.randn(nb, BLOCK, 1, p, device=dev, dtype=dt)
    w = torch.randn(h * (dn + dv), r, device=dev, dtype=dt) * r**-0.5
    ms = _time_ms(lambda: paged_mla_attention(q, c, kr, lat, rop, meta, w, dn, 0.1), dev, reps)
    pairs = sum((cc + 1 + cc + new) * new / 2 for cc in ctx_lens)
    kv_bytes = sum(cc + new for cc in ctx_lens) * (r + p) * 2
    return {"case": label, "ms": ms, "TFLOP/s": 2 * pairs * h * (2 * r + p) / ms / 1e9, "GB/s": kv_bytes / ms / 1e6}


def _mla_speed(dev: str, size: int, reps: int) -> list[dict]:
    half = size // 2
    return [
        _mla_case(dev, f"mla prefill {half}", [0], half, reps),
        _mla_case(dev, f"mla decode batch 32, ctx {half}", [half] * 32, 1, reps),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out/bench_triton_attention.json")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases, max_len, size = (2, 20, 64) if args.tiny else (12, 300, 8192)
    checks = check_attention(dev, cases, max_len) + check_mla(dev, max(1, cases // 3), max_len)
    for row in checks:
        print(json.dumps(row))
    worst = {}
    for row in checks:
        key = f"{row['kernel']} {row['dtype']}"
        worst[key] = max(worst.get(key, 0.0), row["max_err"])
    print("worst max abs error:", worst)
    rows = speed(dev, size, 3 if args.tiny else 20)
    print(f"{'case':45s} {'ms':>9s} {'TFLOP/s':>9s} {'GB/s':>9s}")
    for row in rows:
        print(f"{row['case']:45s} {row['ms']:9.3f} {row['TFLOP/s']:9.1f} {row['GB/s']:9.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                               "checks": checks, "worst": worst, "speed": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
