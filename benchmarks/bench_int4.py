"""Int4 weights (recap/kernels/linear_int4.py) against recap's int8 (Int8Linear: the native int8 kernel over its
tiles at every row count) and fp32 oneDNN on a packed weight, at 1B-model shapes; and the output error of each format.

    .venv/bin/python benchmarks/bench_int4.py [--quick] [--threads 1 2] [--rounds 7] [--json bench_out/int4.json]
        [--models lfm2-1.2b] [--errors-only]

Speed: the calling thread's CPU time at 1 thread (a shared machine's other processes do not count; their memory
traffic does), wall clock at 2 threads (the second thread's time is not the caller's), medians, the variants
alternating within each round, each variant's weights cycled through >= 128 MB (4x this CPU's L3) so that a call
reads its weight from memory as a decode step does. All int4 formats
(symmetric / asymmetric, groups of 32 / 64) at 1 and 8 rows; the default one (Int4Linear's) and the super-block
format (kernels/int4_superblock.py, quantization "int4_k") at every row count. --ab: only those two, side by side.
Models (--models): the greedy batch-1 decode step of a checkpoint with int8 and int4 linears, alternating in one
process (two copies of the model, each prepared by its own CPU backend: native kernels, decode graphs).
Error: relative Frobenius error of the output against the fp64 product with the fp32 weight, random normal weights
(std 0.02) and inputs (normal, and normal with 1% outlier channels 30x larger, as LLM activations have).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402
from profile_decode import decoder  # noqa: E402

from recap.backends import CpuBackend  # noqa: E402
from recap.kernels.linear_int4 import SYM_FITS, int4_linear, quantize_int4  # noqa: E402
from recap.kernels.linear_rows import linear_rows_int8  # noqa: E402
from recap.model.layers.int4_linear import INT4_ASYM, INT4_GROUP  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.quant import quantize_int8_tiles  # noqa: E402

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192), (49152, 2048))  # (out, in): attention, MLP up, down, head
FORMATS = ((False, 32), (True, 32), (False, 64), (True, 64))  # (asym, group)
POOL = 128e6


def _fmt(asym: bool, group: int) -> str:
    return f"int4 {'asym' if asym else 'sym'} g{group}"


SB = "int4 superblock"


def variants(out_f: int, in_f: int, rows: int, ab: bool = False) -> dict[str, Callable[[], object]]:
    """name -> a call on the next of its weight copies (ab: the default int4 format and the super-block one)."""
    x = torch.randn(rows, in_f)
    turn = itertools.count()
    n32 = max(1, int(POOL // (out_f * in_f * 4)))
    ws = [torch.randn(out_f, in_f) * 0.02 for _ in range(min(n32, 2))]  # distinct sources, reused below
    onednn = [torch.ops.mkldnn._reorder_linear_weight(ws[i % len(ws)], 8) for i in range(n32)]
    q8 = quantize_int8_tiles(ws[0], None)  # and copies of its tiles
    t8 = [q8.tiles] + [q8.tiles.clone() for _ in range(max(0, int(POOL // q8.tiles.nbytes) - 1))]

    def int8(j: int) -> torch.Tensor:
        return linear_rows_int8(x, t8[j % len(t8)], q8.row_sums, q8.scales, None, q8.reduce_range)

    out: dict[str, Callable[[], object]] = {
        "fp32 oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn[next(turn) % n32], None, "none", [], ""),
        "int8": lambda: int8(next(turn)),
    }
    if ab:
        out = {}
    for asym, group, sb in [(a, g, False) for a, g in FORMATS if rows in (1, 8) and not ab] + [
            (INT4_ASYM, INT4_GROUP, False), (False, 32, True)]:  # fmt: skip
        q4 = quantize_int4(ws[0], group, asym, superblock=sb)
        qs = [q4] + [replace(q4, packed=q4.packed.clone()) for _ in range(1, int(POOL // q4.packed.nbytes))]
        out[SB if sb else _fmt(asym, group)] = lambda qs=qs: int4_linear(x, qs[next(turn) % len(qs)])
    return out


def speed_row(out_f: int, in_f: int, rows: int, threads: int, rounds: int, ab: bool = False) -> dict[str, Any]:
    fns = variants(out_f, in_f, rows, ab)
    reps = max(3, min(50, int(2e9 // (out_f * in_f * max(rows, 16)))))
    res: dict[str, list[float]] = {v: [] for v in fns}
    clock = time.thread_time if threads == 1 else time.perf_counter
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for v, fn in fns.items():
            t = clock()
            for _ in range(reps):
                fn()
            res[v].append((clock() - t) / reps * 1e3)
    med = {v: statistics.median(ts) for v, ts in res.items()}
    row = {"out": out_f, "in": in_f, "rows": rows, "threads": threads, "ms": med, "load": os.getloadavg()[0]}
    base = med[_fmt(INT4_ASYM, INT4_GROUP)]
    cells = "  ".join(f"{v} {m:.3f}" for v, m in med.items())
    vs = "" if ab else f"int4 vs int8 {med['int8'] / base:.2f}x, vs fp32 {med['fp32 oneDNN'] / base:.2f}x, "
    print(f"t{threads} {in_f:>5}->{out_f:<5} rows {rows:>3}: {cells} ms | {vs}superblock / sym g32 "
          f"{med[SB] / base:.3f}x | load {row['load']:.1f}", flush=True)  # fmt: skip
    return row


def error_rows(out_f: int = 2048, in_f: int = 2048, rows: int = 16) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    xs = {"normal": torch.randn(rows, in_f, generator=g)}
    outlier = xs["normal"].clone()
    outlier[:, torch.randperm(in_f, generator=g)[: in_f // 100]] *= 30
    xs["outliers"] = outlier
    fmts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    q8 = quantize_int8_tiles(w, None)
    fmts["int8"] = lambda x: linear_rows_int8(x, q8.tiles, q8.row_sums, q8.scales, None, q8.reduce_range)
    for asym, group in FORMATS:
        q4 = quantize_int4(w, group, asym)
        fmts[_fmt(asym, group)] = lambda x, q4=q4: int4_linear(x, q4)
    for fit in SYM_FITS:  # the symmetric g32 codes under each fit (the format and kernel the same)
        q4 = quantize_int4(w, 32, sym_fit=fit)
        fmts[f"int4 sym g32 fit {fit}"] = lambda x, q4=q4: int4_linear(x, q4)
    qsb = quantize_int4(w, superblock=True)
    fmts[SB] = lambda x: int4_linear(x, qsb)
    out = []
    for name, f in fmts.items():
        row: dict[str, Any] = {"format": name}
        for xn, x in xs.items():
            ref = x.double() @ w.double().T
            row[xn] = float((f(x).double() - ref).norm() / ref.norm())
        out.append(row)
        print(f"error {name:<26} normal inputs {row['normal']:.4f}  with outliers {row['outliers']:.4f}", flush=True)
    return out


def model_row(name: str, threads: int, rounds: int, cache: Path) -> dict[str, Any]:
    """The batch-1 decode step with int8 and with int4 linears (two copies of the model, each prepared by its own
    CPU backend: decode graphs), alternating."""
    path = build_checkpoint(name, cache / name)
    steps: dict[str, Callable[[], None]] = {}
    for q in ("int8", "int4"):
        lm = load_model(path, quantization=q)
        cpu = CpuBackend(q)
        cpu.prepare(lm.model)
        steps[q] = decoder(lm.model, cpu, 1, rounds * 25 + 10)
    res: dict[str, list[float]] = {q: [] for q in steps}
    clock = time.thread_time if threads == 1 else time.perf_counter
    with torch.inference_mode():
        for _ in range(rounds):
            for q, step in steps.items():
                step()
                ts = []
                for _ in range(20):
                    t = clock()
                    step()
                    ts.append(clock() - t)
                res[q].append(1e3 * statistics.median(ts))
    med = {q: statistics.median(v) for q, v in res.items()}
    row = {"model": name, "threads": threads, "ms": med, "load": os.getloadavg()[0]}
    print(f"t{threads} {name} decode step (decode graph): int8 {med['int8']:.2f} ms, int4 {med['int4']:.2f} ms: "
          f"{med['int8'] / med['int4']:.2f}x | load {row['load']:.1f}", flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8, 1 thread, 3 rounds")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--models", nargs="*", default=[], help="checkpoints (benchmarks/checkpoints.py) to decode")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--ab", action="store_true", help="speed of the default int4 format and the super-block one only")
    ap.add_argument("--shapes", nargs="+", type=int, default=None, help="(out in) pairs instead of SHAPES")
    ap.add_argument("--errors-only", action="store_true", help="the output error table only (1 thread)")
    args = ap.parse_args()
    if args.errors_only:
        torch.set_num_threads(1)
        args.threads, args.models = [], []
    if args.quick:
        args.threads, args.rows, args.rounds = [1], [1, 8], 3
    shapes = SHAPES if args.shapes is None else tuple(zip(args.shapes[::2], args.shapes[1::2]))
    out: dict[str, Any] = {"errors": error_rows(), "speed": [], "models": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        out["models"] += [model_row(m, threads, args.rounds, args.cache_dir) for m in args.models]
        for rows in args.rows:
            out["speed"] += [speed_row(o, i, rows, threads, args.rounds, args.ab) for o, i in shapes]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
