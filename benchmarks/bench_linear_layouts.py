"""Which one weight layout a dense linear layer keeps: every layout on every row count, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_linear_layouts.py [--reps 5] [--out bench_out/layouts.json]

1 thread, 1B-model shapes (2048 -> 2048, 2048 -> 8192, 8192 -> 2048, 2048 -> 49152), rows 1, 8, 32, 512, 2048.
fp32 layouts: "panels" (kernels/linear_rows.py's 32-column panels, the native kernel for every row count),
"row" (the one-row kernel on the row-major weight, 1 row only), "onednn" (oneDNN's copy packed for 8 rows),
"mkl" (F.linear on the row-major weight). bf16: "onednn" and "torch" (F.linear). Within a repetition the layouts
alternate (a shared machine's drift hits them alike); medians in ms, and GFLOP/s. Small weights are cycled
through copies of >= 128 MB so that every call reads its weight from memory, as a decode step does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from recap.kernels.linear_rows import linear_panels_f32, linear_rows_f32, pack_panels
from recap.model.layers.linear import _pack

SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048), (2048, 49152)]  # (in, out)
ROWS = [1, 8, 32, 512, 2048]
STREAM_BYTES = 128 << 20


def _layouts(k: int, out: int, dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    nbytes = k * out * (4 if dtype == torch.float32 else 2)
    copies = max(1, -(-STREAM_BYTES // nbytes)) if nbytes < STREAM_BYTES else 1
    ws = [torch.randn(out, k).to(dtype) for _ in range(copies)]
    packed = [_pack(w) for w in ws]
    if dtype == torch.bfloat16:
        return {"onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i % copies], None, "none", [], ""),
                "torch": lambda x, i: F.linear(x, ws[i % copies])}  # fmt: skip
    panels = [pack_panels(w) for w in ws]
    return {
        "panels": lambda x, i: linear_panels_f32(x, panels[i % copies], None, out),
        "row": lambda x, i: linear_rows_f32(x, ws[i % copies], None),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i % copies], None, "none", [], ""),
        "mkl": lambda x, i: F.linear(x, ws[i % copies]),
    }


def measure(k: int, out: int, dtype: torch.dtype, reps: int) -> list[dict]:
    layouts = _layouts(k, out, dtype)
    rows_out = []
    for n in ROWS:
        x = torch.randn(n, k).to(dtype)
        names = [name for name in layouts if not (name == "row" and n > 1)]
        calls = max(1, min(50, int(2e9 / (2 * n * k * out))))  # ~20 ms of work per timing at 100 GF/s
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            layouts[name](x, 0)  # warm-up (oneDNN's primitive cache, the library load)
        for _ in range(reps):
            for name in names:
                t0 = time.perf_counter()
                for i in range(calls):
                    layouts[name](x, i)
                times[name].append((time.perf_counter() - t0) / calls * 1e3)
        for name in names:
            ms = statistics.median(times[name])
            rows_out.append({"dtype": str(dtype).removeprefix("torch."), "in": k, "out": out, "rows": n,
                             "layout": name, "ms": ms, "gflops": 2 * n * k * out / ms / 1e6})  # fmt: skip
            print(f"{rows_out[-1]['dtype']:8} {k:5} -> {out:5} rows {n:4} {name:7} {ms:9.3f} ms "
                  f"{rows_out[-1]['gflops']:6.1f} GF/s", flush=True)  # fmt: skip
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    with torch.inference_mode():
        for dtype in args.dtypes:
            for k, out in SHAPES:
                results += measure(k, out, getattr(torch, dtype), args.reps)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
