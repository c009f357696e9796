"""Whole batch-1 decode steps of real-shape checkpoints: this checkout against a git revision's int4 kernel,
alternating (each first in turn) within every round of one process on the same model, caches and tokens.

    .venv/bin/python benchmarks/bench_decode_ab.py [--models lfm2-1.2b granite-h-1b] [--ref main] [--rounds 7]
        [--steps 5] [--ref-module-path lfm2-1.2b]

Variant "ref": csrc/linear_int4.c of `--ref` built with native.py's flags, swapped in for this checkout's in the
decode graph's calls and the module path's; a model named in --ref-module-path runs its module path in the ref
rounds (the revision's engine did not capture it in a decode graph: LFM2 before this branch). Variant "this":
the engine as it is. Each step is profile_decode.py's (ForwardBatch, model, logits, greedy token), timed as the
calling thread's CPU time (other processes of a shared box do not count; their memory traffic does); the table
gives the median over rounds of each round's median step, the ratio, and the 1-minute load. int4 weights, fp32
activations, 1 thread.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel_ab import ROOT, build  # noqa: E402
from checkpoints import DEFAULT_CACHE  # noqa: E402
from profile_decode import decoder  # noqa: E402

import recap.kernels.linear_int4 as linear_int4  # noqa: E402
from recap.backends import prepare  # noqa: E402
from recap.backends.decode_graph import DecodeGraph  # noqa: E402
from recap.kernels.native import raw_function  # noqa: E402
from recap.model.loader import load_model  # noqa: E402


def _address(fn: object) -> int | None:
    return ctypes.cast(fn, ctypes.c_void_p).value if isinstance(fn, ctypes._CFuncPtr) else None


class RefSwitch:
    """Turns the ref variant on and off: the int4 library the module path loads, each captured graph's int4
    calls, and (module_path) whether the graphs replay at all."""

    def __init__(self, ref_lib: ctypes.CDLL, module_path: bool) -> None:
        self.ref_lib, self.module_path, self.on = ref_lib, module_path, False
        self._lib = linear_int4._lib
        self.this_lib = self._lib()
        self.graphs: list[tuple[DecodeGraph, list, list]] = []  # graph, this checkout's calls, the ref's
        self._takes = DecodeGraph.takes

    def install(self) -> None:
        switch = self

        def takes(graph: DecodeGraph, batch) -> bool:  # type: ignore[no-untyped-def]
            if not any(g is graph for g, _, _ in switch.graphs):
                switch._add(graph)
            return switch._takes(graph, batch) and not (switch.on and switch.module_path)

        DecodeGraph.takes = takes  # type: ignore[method-assign]
        linear_int4._lib = lambda: self.ref_lib if self.on else self.this_lib  # type: ignore[assignment]

    def uninstall(self) -> None:
        DecodeGraph.takes = self._takes  # type: ignore[method-assign]
        linear_int4._lib = self._lib  # type: ignore[assignment]

    def _add(self, graph: DecodeGraph) -> None:
        this_fn = _address(self.this_lib.recap_linear_int4)
        ref_fn = raw_function(self.ref_lib, "recap_linear_int4", ctypes.c_int)
        ops = list(graph._ops)
        ref_ops = [(ref_fn, *op[1:]) if _address(op[0]) == this_fn else op for op in ops]
        swapped = sum(a is not b for a, b in zip(ops, ref_ops))
        if swapped == 0:
            raise RuntimeError("a decode graph without int4 calls: is the model int4?")
        print(f"  graph of {graph.rows} rows: {swapped} int4 calls of {len(ops)} swapped in the ref rounds", flush=True)
        self.graphs.append((graph, ops, ref_ops))

    def set(self, on: bool) -> None:
        self.on = on
        for graph, ops, ref_ops in self.graphs:
            graph._ops = ref_ops if on else ops


def measure(step: Callable[[], None], switch: RefSwitch, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per round and variant, the median thread-CPU seconds of `steps` steps; the variants alternate."""
    res: dict[str, list[float]] = {"ref": [], "this": []}
    for i in range(rounds):
        for name in list(res)[:: 1 if i % 2 == 0 else -1]:  # ABBA: the one run first in a round ran slower
            switch.set(name == "ref")
            step()  # the first step after a switch: not timed
            ts = []
            for _ in range(steps):
                t = time.thread_time()
                step()
                ts.append(time.thread_time() - t)
            res[name].append(statistics.median(ts))
    switch.set(False)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lfm2-1.2b", "granite-h-1b"])
    ap.add_argument("--ref", default="main", help="git revision whose csrc/linear_int4.c the ref variant runs")
    ap.add_argument("--ref-module-path", nargs="*", default=["lfm2-1.2b"],
                    help="models whose ref rounds run the module path (no decode graph)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = subprocess.run(["git", "show", f"{args.ref}:recap/kernels/csrc/linear_int4.c"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        ref_lib = build(src, "linear_int4_ref", Path(d))
    print(f"| model | ref ({args.ref}) ms/step | this ms/step | speedup | ref rounds | this rounds | load |")
    print("|---|---:|---:|---:|---|---|---|")
    for name in args.models:
        lm = load_model(args.cache_dir / name, torch.float32, quantization="int4")
        backend = prepare(lm)
        switch = RefSwitch(ref_lib, name in args.ref_module_path)
        switch.install()
        try:
            step = decoder(lm.model, backend, 1, args.rounds * (args.steps + 1) * 2 + 8)
            for _ in range(3):
                step()
            load0 = os.getloadavg()[0]
            res = measure(step, switch, args.rounds, args.steps)
        finally:
            switch.uninstall()
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        rounds = {k: " / ".join(f"{x * 1e3:.1f}" for x in v) for k, v in res.items()}
        print(f"| {name} | {med['ref']:.2f} | {med['this']:.2f} | {med['ref'] / med['this']:.3f}x | {rounds['ref']} "
              f"| {rounds['this']} | {load0:.1f}-{os.getloadavg()[0]:.1f} |", flush=True)
        del lm, backend, step


if __name__ == "__main__":
    main()
