"""Batch-1 decode: the compiled one-row linear (recap/model/layers/rowvec.py) against the oneDNN backend.

    .venv/bin/python benchmarks/bench_rowvec.py [--models mamba2-115m hybrid-163m] [--rounds 5]

Two parts, thread CPU time (time.thread_time: other processes' time slices do not count, their memory traffic
does), medians, the variants alternating within each round, the 1-minute load average printed:
1. the mat-vec alone for the linear shapes of these models, weights cycled through ~200 MB so that every call
   reads its weight from memory as a decode step does;
2. the whole greedy decode step (benchmarks/profile_decode.py's), the same model switched between the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402
from profile_decode import decoder  # noqa: E402

from recap.bench.timing import timings  # noqa: E402
from recap.model.layers.rowvec import rowvec_available, rowvec_linear  # noqa: E402
from recap.model.loader import load_model  # noqa: E402

SHAPES = ((3352, 768), (1536, 768), (768, 1536), (1024, 768), (768, 1024), (32000, 768))


def cpu_ms(fn: Callable[[], object], n: int) -> float:
    return 1e3 * statistics.median(timings(fn, n))


def kernels(rounds: int) -> None:
    print(f"{'out x in':>12} {'oneDNN ms':>10} {'rowvec ms':>10} {'speedup':>8} {'GB/s rowvec':>12}")
    for out_f, in_f in SHAPES:
        ma, mb = kernel_pair(out_f, in_f, rounds)
        gbs = out_f * in_f * 4 / (mb / 1e3) / 1e9
        print(f"{out_f:>6}x{in_f:<5} {ma:>10.3f} {mb:>10.3f} {ma / mb:>7.2f}x {gbs:>12.1f}")


def kernel_pair(out_f: int, in_f: int, rounds: int) -> tuple[float, float]:
    """Median ms of oneDNN's packed linear and of rowvec_linear at one row, weights read from memory."""
    k = max(2, int(200e6 // (out_f * in_f * 4)))
    ws = [torch.randn(out_f, in_f) * 0.02 for _ in range(k)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    x = torch.randn(1, in_f)
    i = [0]

    def nxt() -> int:
        i[0] = (i[0] + 1) % k
        return i[0]

    a, b = [], []
    with torch.inference_mode():
        for _ in range(rounds):
            a.append(cpu_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed[nxt()], None, "none", [], ""), 20))
            b.append(cpu_ms(lambda: rowvec_linear(x, ws[nxt()], None), 20))
    return statistics.median(a), statistics.median(b)


VARIANTS = {"oneDNN": False, "rowvec": True}


def steps(models: list[str], rounds: int, cache: Path) -> None:
    for name in models:
        model = load_model(build_checkpoint(name, cache / name), compile_decode=True).model
        step = decoder(model, 1, rounds * len(VARIANTS) * 25 + 10)
        res: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v, on in VARIANTS.items():
                model.set_compiled_decode(on)
                res[v].append(cpu_ms(step, 20))
        med = {v: statistics.median(x) for v, x in res.items()}
        print(f"{name}: decode step ms " + ", ".join(f"{v} {m:.2f}" for v, m in med.items())
              + f" (1-min load {os.getloadavg()[0]:.1f})")  # fmt: skip
        del model, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mamba2-115m", "hybrid-163m"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the kernel serves 1-thread processes only
    t = time.perf_counter()
    if not rowvec_available():
        sys.exit("torch.compile cannot build the one-row kernel here")
    print(f"compile: {time.perf_counter() - t:.1f} s wall, load {os.getloadavg()[0]:.1f}")
    if not args.skip_kernels:
        kernels(args.rounds)
    steps(args.models, args.rounds, args.cache_dir)


if __name__ == "__main__":
    main()
