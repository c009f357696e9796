"""Int8 linear layers at 1B-model shapes: recap's native int8 kernel over its tiles (csrc/linear_int8.c, every
row count) against fbgemm's dynamic int8 linear on its own packed copy (`quant.int8_linear`) and oneDNN fp32 on
a packed weight (`mkldnn._linear_pointwise`).

    .venv/bin/python benchmarks/bench_int8_gemm.py [--threads 1 2] [--reps 5] [--quick] [--clock auto]
        [--json bench_out/int8_gemm.json]

Medians of --reps calls per variant, the three variants alternating within every round (one process: the
machine's load moves them together), torch's and the native kernel's threads both set to each --threads count.
Clock: `auto` takes the calling thread's CPU time at 1 thread (on a shared machine a call descheduled for a
4 ms time slice otherwise reads 4 ms longer, which swamped 1-10 ms calls at a load of 5-10) and wall time at
more threads (the workers' time is not the caller's); `wall` or `cpu` everywhere. GOP/s counts
2 * rows * in * out. The weights are not cycled: at 1 and 8 rows an int8 weight of 2048x2048 (4 MiB) is read
from L3 here, the larger ones from memory. --quick: two shapes, rows 1, 64 and 512, 3 reps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recap.kernels.linear_rows import linear_rows_available, linear_rows_int8, pack_int8  # noqa: E402
from recap.model.quant import int8_linear, quantize_int8  # noqa: E402

SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048), (2048, 49152))  # (in, out): attention, MLP up/down, LM head
ROWS = (1, 8, 64, 512, 2048)
VARIANTS = ("native int8", "fbgemm int8", "oneDNN fp32")


def _variants(in_f: int, out_f: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(in_f * 7 + out_f)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    q = quantize_int8(w, None)
    tiles = pack_int8(q.qweight)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    return {
        "native int8": lambda x: linear_rows_int8(x, tiles, q.row_sums, q.scales, None, q.reduce_range),
        "fbgemm int8": lambda x: int8_linear(x, q),
        "oneDNN fp32": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }


def _cell(fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, reps: int,
          clock: Callable[[], float]) -> dict[str, float]:  # fmt: skip
    """Median ms of each variant on x, the variants alternating within every rep."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(x)  # warm: first-call allocations, oneDNN's primitive cache
    for _ in range(reps):
        for name, fn in fns.items():
            t = clock()
            fn(x)
            times[name].append(clock() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def _clock(name: str, threads: int) -> tuple[str, Callable[[], float]]:
    name = ("cpu" if threads == 1 else "wall") if name == "auto" else name
    return name, time.thread_time if name == "cpu" else time.perf_counter


def run(threads: list[int], shapes: tuple, rows: tuple, reps: int, clock: str) -> list[dict[str, Any]]:
    out = []
    for in_f, out_f in shapes:
        fns = _variants(in_f, out_f)
        for th in threads:
            torch.set_num_threads(th)  # the native kernel takes torch.get_num_threads() threads too
            clock_name, clock_fn = _clock(clock, th)
            for n in rows:
                x = torch.randn(n, in_f)
                ms = _cell(fns, x, reps, clock_fn)
                gops = {k: 2 * n * in_f * out_f / (v * 1e6) for k, v in ms.items()}
                row = {"in": in_f, "out": out_f, "threads": th, "rows": n, "ms": ms, "gops": gops,
                       "load": os.getloadavg()[0], "clock": clock_name}  # fmt: skip
                out.append(row)
                _print_row(row)
        del fns
    return out


def _print_row(r: dict[str, Any]) -> None:
    ms, gops = r["ms"], r["gops"]
    nat = ms["native int8"]
    cells = " | ".join(f"{ms[v]:.3f} ({gops[v]:.0f})" for v in VARIANTS)
    print(f"| {r['in']}->{r['out']} | {r['threads']} ({r['clock']}) | {r['rows']} | {cells} | "
          f"{ms['fbgemm int8'] / nat:.2f}x | {ms['oneDNN fp32'] / nat:.2f}x | {r['load']:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="two shapes, rows 1 / 64 / 512, 3 reps")
    ap.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto")
    ap.add_argument("--json", type=Path, default=Path("bench_out/int8_gemm.json"))
    args = ap.parse_args()
    if not linear_rows_available():
        sys.exit("the native kernels do not build here (no C compiler)")
    shapes, rows, reps = (SHAPES[:2], (1, 64, 512), 3) if args.quick else (SHAPES, ROWS, args.reps)
    print("ms (GOP/s) per call, medians; speed-up = that variant's time / native's")
    print("| in->out | thr | rows | " + " | ".join(f"{v} ms (GOP/s)" for v in VARIANTS)
          + " | native vs fbgemm | native vs oneDNN | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = run(args.threads, shapes, rows, reps, args.clock)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"reps": reps, "rows": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
