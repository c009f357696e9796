"""Decode through recap's native kernels (recap/kernels/linear_rows.py, recap/kernels/mamba2_step.py) against
torch's kernels (oneDNN, fbgemm and the torch Mamba2 decode path).

    .venv/bin/python benchmarks/bench_native_decode.py [--models mamba2-115m hybrid-163m] [--threads 1 2]
        [--rounds 5] [--skip-kernels] [--json bench_out/native_decode.json]

Wall clock (a 2-thread kernel's second thread is not in the calling thread's CPU time), medians, the variants
alternating within each round, the 1-minute load average printed with every row:
1. one-row linears for these models' shapes, weights cycled through ~400 MB so that every call reads its
   weight from memory as a decode step does: oneDNN vs native fp32, fbgemm vs native int8, with GB/s;
2. few-row linears (batched decode, short prefills), GFLOP/s, weights cycled through ~400 MB: fp32, oneDNN
   on its packed copy vs the native panel kernel (linear_panels_f32); int8, fbgemm vs the native int8 kernel;
3. the greedy batch-1 decode step (benchmarks/profile_decode.py's) with native kernels on (the decode graph)
   and off (fp32 and int8 weights), and how much of the eager step the linear layers take.
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402
from profile_decode import decoder  # noqa: E402

from recap.backends import Backend, CpuBackend, TorchBackend  # noqa: E402
from recap.bench.timing import timings  # noqa: E402
from recap.kernels.linear_rows import (  # noqa: E402
    linear_panels_f32,
    linear_rows_available,
    linear_rows_f32,
    linear_rows_int8,
    pack_int8,
    pack_panels,
)
from recap.kernels.metadata import ForwardBatch  # noqa: E402
from recap.model.cache import ModelCaches, TensorAllocator  # noqa: E402
from recap.model.layers import linear as linear_mod  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.models import CausalLM  # noqa: E402
from recap.model.quant import int8_linear, quantize_int8  # noqa: E402

SHAPES = ((3352, 768), (768, 1536), (1024, 768), (768, 1024), (4096, 1024), (32000, 768))


def wall_ms(fn: Callable[[], object], n: int) -> float:
    return 1e3 * statistics.median(timings(fn, n, clock=time.perf_counter))


def kernel_row(out_f: int, in_f: int, rounds: int, threads: int) -> dict[str, Any]:
    """One shape's one-row linears, each variant on its own weights cycled from memory."""
    k = max(2, int(400e6 // (out_f * in_f * 4)))
    ws = [torch.randn(out_f, in_f) * 0.02 for _ in range(k)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    qs = [quantize_int8(w, None) for w in ws[: max(2, k // 4)]]  # int8: a quarter of the bytes
    qp = [pack_int8(q.qweight) for q in qs]
    x = torch.randn(1, in_f)
    turn = itertools.count()

    def native_int8() -> torch.Tensor:
        j = next(turn) % len(qs)
        return linear_rows_int8(x, qp[j], qs[j].row_sums, qs[j].scales, None, qs[j].reduce_range)

    variants: dict[str, Callable[[], object]] = {
        "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed[next(turn) % k], None, "none", [], ""),
        "native f32": lambda: linear_rows_f32(x, ws[next(turn) % k], None),
        "fbgemm int8": lambda: int8_linear(x, qs[next(turn) % len(qs)]),
        "native int8": native_int8,
    }
    res: dict[str, list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        for _ in range(rounds):
            for v, fn in variants.items():
                res[v].append(wall_ms(fn, 20))
    med = {v: statistics.median(x) for v, x in res.items()}
    row = {"threads": threads, "shape": f"{out_f}x{in_f}", "load": os.getloadavg()[0], "ms": med}
    row["GB/s"] = {v: out_f * in_f * (1 if "int8" in v else 4) / (m / 1e3) / 1e9 for v, m in med.items()}
    print(f"t{threads} {row['shape']:>10}: " + "  ".join(f"{v} {m:.3f} ms ({row['GB/s'][v]:.1f} GB/s)"
                                                      for v, m in med.items()) + f"  load {row['load']:.1f}")
    return row


PANEL_ROWS = (2, 8, 16, 32, 48, 64)


def _few_rows(kind: str, out_f: int, in_f: int, rounds: int, threads: int,
              variants_at: Callable[[torch.Tensor], dict[str, Callable[[], object]]]) -> dict[str, Any]:
    """One shape's few-row linears at several row counts, the variants alternating within each round."""
    row: dict[str, Any] = {"threads": threads, "shape": f"{out_f}x{in_f}", "load": os.getloadavg()[0], "GF/s": {}}
    cells = []
    with torch.inference_mode():
        for n in PANEL_ROWS:
            variants = variants_at(torch.randn(n, in_f))
            res: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(rounds):
                for v, fn in variants.items():
                    res[v].append(wall_ms(fn, 10))
            gf = {v: 2 * n * out_f * in_f / (statistics.median(m) / 1e3) / 1e9 for v, m in res.items()}
            row["GF/s"][n] = gf
            cells.append(f"{n}: " + "/".join(f"{g:.0f}" for g in gf.values()))
    print(f"t{threads} {row['shape']:>10} GF/s {kind} by rows  " + "  ".join(cells) + f"  load {row['load']:.1f}")
    return row


def panel_row(out_f: int, in_f: int, rounds: int, threads: int) -> dict[str, Any]:
    """fp32: oneDNN on its packed copy vs the panel kernel, each on its own weights cycled from memory."""
    k = max(2, int(400e6 // (out_f * in_f * 4)))
    ws = [torch.randn(out_f, in_f) * 0.02 for _ in range(k)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    panels = [pack_panels(w) for w in ws]
    del ws
    turn = itertools.count()
    return _few_rows("oneDNN/panels", out_f, in_f, rounds, threads, lambda x: {
        "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed[next(turn) % k], None, "none", [], ""),
        "panels": lambda: linear_panels_f32(x, panels[next(turn) % k], None, out_f),
    })  # fmt: skip


def int8_rows_row(out_f: int, in_f: int, rounds: int, threads: int) -> dict[str, Any]:
    """int8 weights: fbgemm's dynamic linear vs the native int8 kernel, each on its own weights from memory."""
    k = max(2, int(400e6 // (out_f * in_f)))
    qs = [quantize_int8(torch.randn(out_f, in_f) * 0.02, None) for _ in range(k)]
    tiles = [pack_int8(q.qweight) for q in qs]
    turn = itertools.count()

    def native(x: torch.Tensor) -> torch.Tensor:
        i = next(turn) % k
        return linear_rows_int8(x, tiles[i], qs[i].row_sums, qs[i].scales, None, qs[i].reduce_range)

    return _few_rows("fbgemm/native int8", out_f, in_f, rounds, threads, lambda x: {
        "fbgemm": lambda: int8_linear(x, qs[next(turn) % k]), "native": lambda: native(x),
    })  # fmt: skip


class LinearClock:
    """Wall time spent inside Linear.forward while installed (a context manager)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._forward = linear_mod.Linear.forward

    def __enter__(self) -> LinearClock:
        forward, clock = self._forward, self

        def timed(layer: linear_mod.Linear, x: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            y = forward(layer, x)
            clock.seconds += time.perf_counter() - t
            return y

        linear_mod.Linear.forward = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        linear_mod.Linear.forward = self._forward  # type: ignore[method-assign]


class Switch:
    """The backend a decoder closure runs through, switched between rounds (each prepares the model anew)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.kernels = backend.kernels

    def use(self, backend: Backend, model: CausalLM) -> None:
        if not backend.serves(model):
            backend.prepare(model)
        self.backend, self.kernels = backend, backend.kernels

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        return self.backend.forward(model, batch, caches)

    def cache_zeros(self) -> TensorAllocator | None:
        return self.backend.cache_zeros()


def step_row(name: str, quant: str | None, rounds: int, threads: int, cache: Path) -> dict[str, Any]:
    """The batch-1 decode step with native kernels off and on, alternating; the linears' share of each."""
    lm = load_model(build_checkpoint(name, cache / name), quantization=quant)
    backends = {"torch": TorchBackend(lm.linear_backend), "native": CpuBackend(lm.linear_backend)}
    backends["native"].prepare(lm.model)  # the weights on huge pages for both (the torch backend leaves them)
    model = lm.model
    switch = Switch(backends["native"])
    step = decoder(model, switch, 1, rounds * 2 * 25 + 10)
    res: dict[str, list[float]] = {"torch": [], "native": []}
    share: dict[str, list[float]] = {"torch": [], "native": []}
    with LinearClock() as clock:
        for _ in range(rounds):
            for v in res:
                switch.use(backends[v], model)
                clock.seconds = 0.0
                ts = timings(step, 20, clock=time.perf_counter)
                res[v].append(1e3 * statistics.median(ts))
                share[v].append(clock.seconds / (sum(ts) + ts[0]))  # the warm-up call counts in the clock too
    med = {v: statistics.median(x) for v, x in res.items()}
    lin = {v: statistics.median(x) for v, x in share.items()}
    row = {"model": name, "weights": quant or "fp32", "threads": threads, "ms": med, "linear share": lin,
           "load": os.getloadavg()[0]}  # fmt: skip
    del row["linear share"]["native"]  # the decode graph calls the kernels without Linear.forward
    print(f"t{threads} {name} {row['weights']}: decode step torch {med['torch']:.2f} ms (linears "
          f"{100 * lin['torch']:.0f}%), native (decode graph) {med['native']:.2f} ms: "
          f"{med['torch'] / med['native']:.2f}x, load {row['load']:.1f}")  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mamba2-115m", "hybrid-163m"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t = time.perf_counter()
    if not linear_rows_available():
        sys.exit("the native kernels cannot be built here (see the warning above)")
    print(f"native kernels ready in {time.perf_counter() - t:.1f} s")
    out: dict[str, Any] = {"kernels": [], "panels": [], "int8_rows": [], "steps": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        if not args.skip_kernels:
            out["kernels"] += [kernel_row(o, i, args.rounds, threads) for o, i in SHAPES]
            out["panels"] += [panel_row(o, i, args.rounds, threads) for o, i in SHAPES[:-1]]
            out["int8_rows"] += [int8_rows_row(o, i, args.rounds, threads) for o, i in SHAPES[:-1]]
        for model in args.models:
            out["steps"] += [step_row(model, q, args.rounds, threads, args.cache_dir) for q in (None, "int8")]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
