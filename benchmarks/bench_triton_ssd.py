"""Triton SSD against the torch SSD on one GPU (recap/kernels/triton/ssd.py vs recap/kernels/ssd.py).

A long prefill (one row, bf16 activations, fp32 states) without checkpoints and with one at every 16-token
block, then decode steps of 1, 32 and 128 rows. Prints a table (and JSON with --json): milliseconds, tokens/s,
the Triton kernels' share of the card's bf16 TFLOP/s (prefill) or HBM bytes/s (decode; Triton timed as
CUDA graph replays, as decode steps run), and the largest difference from the torch kernel. Needs a GPU:
    python benchmarks/bench_triton_ssd.py --tokens 8192 --heads 64 --head-dim 64 --state 128 --groups 8
"""

from __future__ import annotations

import argparse
import json

import torch

from recap.bench.timing import cuda_median_ms
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.ssd import ssd as torch_ssd
from recap.kernels.ssd_decode import ssd_state_update as torch_update
from recap.kernels.triton.ssd import ssd as triton_ssd
from recap.kernels.triton.ssd_decode import ssd_state_update as triton_update

HBM_BYTES_S = 3.35e12  # H100 SXM
BF16_FLOP_S = 989e12  # dense


def _inputs(t: int, h: int, p: int, n: int, g: int, gen: torch.Generator) -> tuple:
    dev = "cuda"
    x = torch.randn(t, h, p, generator=gen).to(dev, torch.bfloat16)
    dt = (torch.randn(t, h, generator=gen) - 3).to(dev, torch.bfloat16)
    a = -torch.rand(h, generator=gen).to(dev) * 8
    b = torch.randn(t, g, n, generator=gen).to(dev, torch.bfloat16)
    c = torch.randn(t, g, n, generator=gen).to(dev, torch.bfloat16)
    d, bias = torch.randn(h, generator=gen).to(dev), torch.randn(h, generator=gen).to(dev)
    return x, dt, a, b, c, d, bias, True, (0.0, float("inf"))


def _meta(specs: list[SeqSpec]) -> SSMMetadata:
    fb = build_forward_batch(specs, block_size=16, chunk_size=256, with_attention=False, with_ssm=True, device="cuda")
    assert fb.ssm is not None
    return fb.ssm


def _prefill(t: int, h: int, p: int, n: int, g: int, every_block: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    args = _inputs(t, h, p, n, g, gen)
    cps = [(q, 1 + q // 16) for q in range(16, t + 1, 16)] if every_block else []
    meta = _meta([SeqSpec([0] * t, state_slot=0, checkpoints=cps)])
    cache = torch.zeros(2 + t // 16, h, p, n, device="cuda")
    ref = cache.clone()
    y, y_ref = triton_ssd(*args, cache, meta), torch_ssd(*args, ref, meta)
    err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
    state_err = ((cache - ref).abs().max() / ref.abs().max()).item()
    ms = cuda_median_ms(lambda: triton_ssd(*args, cache, meta), reps=10, warm=2)
    ms_torch = cuda_median_ms(lambda: torch_ssd(*args, ref, meta), reps=3, warm=2)
    flops = t * h * (2 * 64 * n + 2 * 64 * p + 4 * p * n)  # per token and head: C B^T, L Delta x, C h, x B^T
    return {
        "case": f"prefill T={t}" + (" ckpt/16" if every_block else ""), "triton_ms": ms, "torch_ms": ms_torch,
        "tok_s": t / ms * 1e3, "frac_peak": flops / (ms * 1e-3) / BF16_FLOP_S, "rel_err": max(err, state_err),
    }  # fmt: skip


def _decode(rows: int, h: int, p: int, n: int, g: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    x, dt, a, b, c, d, bias, soft, limit = _inputs(rows, h, p, n, g, gen)
    idx = torch.arange(rows, device="cuda")
    pos = torch.full((rows,), 100, device="cuda")
    cache = torch.randn(rows, h, p, n, generator=gen).to("cuda")
    ref = cache.clone()
    sp = torch.zeros(rows, dtype=torch.int64, device="cuda")

    def run(fn, state: torch.Tensor) -> torch.Tensor:
        return fn(state, x, dt, a, b, c, d, bias, soft, limit, idx, sp, pos)

    y, y_ref = run(triton_update, cache), run(torch_update, ref)
    err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
    graph = torch.cuda.CUDAGraph()  # as a decode step runs: replayed, no launch overhead
    with torch.cuda.graph(graph):
        run(triton_update, cache)
    ms = cuda_median_ms(graph.replay, reps=10, warm=2)
    ms_torch = cuda_median_ms(lambda: run(torch_update, ref), reps=3, warm=2)
    state_bytes = 2 * rows * h * p * n * 4  # read and write of each row's fp32 state
    return {
        "case": f"decode B={rows}", "triton_ms": ms, "torch_ms": ms_torch, "tok_s": rows / ms * 1e3,
        "frac_peak": state_bytes / (ms * 1e-3) / HBM_BYTES_S, "rel_err": err,
    }  # fmt: skip


def _profile(t: int, h: int, p: int, n: int, g: int, every_block: bool) -> None:
    """CUDA time per kernel of one Triton prefill."""
    args = _inputs(t, h, p, n, g, torch.Generator().manual_seed(0))
    cps = [(q, 1 + q // 16) for q in range(16, t + 1, 16)] if every_block else []
    meta = _meta([SeqSpec([0] * t, state_slot=0, checkpoints=cps)])
    cache = torch.zeros(2 + t // 16, h, p, n, device="cuda")
    triton_ssd(*args, cache, meta)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        triton_ssd(*args, cache, meta)
        torch.cuda.synchronize()
    times = [(e.key, getattr(e, "device_time_total", 0.0) / 1e3) for e in prof.key_averages()]
    times = [(k, ms) for k, ms in times if ms > 0]
    print("kernels" + (" (ckpt/16)" if every_block else ""), ", ".join(f"{k} {ms:.3f} ms" for k, ms in times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also print each kernel's time in one prefill")
    a = ap.parse_args()
    shape = (a.heads, a.head_dim, a.state, a.groups)
    rows = [_prefill(a.tokens, *shape, every_block=False), _prefill(a.tokens, *shape, every_block=True)]
    rows += [_decode(r, *shape) for r in (1, 32, 128)]
    print(f"{torch.cuda.get_device_name()}  H={a.heads} P={a.head_dim} N={a.state} G={a.groups}")
    print(f"{'case':<22}{'triton ms':>11}{'torch ms':>11}{'tok/s':>13}{'of peak':>9}{'rel err':>10}")
    for r in rows:
        print(f"{r['case']:<22}{r['triton_ms']:>11.3f}{r['torch_ms']:>11.3f}{r['tok_s']:>13.0f}"
              f"{r['frac_peak']:>9.1%}{r['rel_err']:>10.1e}")  # fmt: skip
    if a.profile:
        _profile(a.tokens, *shape, every_block=False)
        _profile(a.tokens, *shape, every_block=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
