"""The output head's precision under int4 (model/head_format.py) at 1B shapes: the batch-1 decode step (decode
graph + the head's logits) with the head at int4 (`head_quantization="same"`) and at int8 (int4's default),
alternating in one process, and what each holds.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_head_format.py [--models granite-h-1b lfm2-1.2b] [--rounds 9]

Models: benchmarks/real_shapes.py's random bf16 checkpoints (~/.cache/recap/bench-models), each loaded twice (once
per head format), each prepared by its own CPU backend. Time: the calling thread's CPU time at 1 thread (a shared
machine's other processes do not count; their memory traffic does), per round the median of 20 steps, the median of
the rounds; the formats alternate within each round. Memory: held_weight_bytes of each prepared model (steady RSS
per format, each in its own process, is peers.py's `--recap-formats int4 int4+head4` row).
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
from profile_decode import decoder  # noqa: E402
from real_shapes import DEFAULT_CACHE, build_checkpoint  # noqa: E402

from recap.backends import prepare  # noqa: E402
from recap.model.footprint import held_weight_bytes  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.process.heap import retain_freed_memory  # noqa: E402

HEADS = {"int4 (head int4)": "same", "int4 + int8 head": "int8"}


def model_row(name: str, rounds: int, cache: Path) -> dict[str, object]:
    path = build_checkpoint(name, cache)
    steps: dict[str, Callable[[], None]] = {}
    held: dict[str, int] = {}
    for label, head in HEADS.items():
        lm = load_model(path, quantization="int4", head_quantization=head)
        backend = prepare(lm)
        held[label] = held_weight_bytes(lm.model).total
        steps[label] = decoder(lm.model, backend, 1, rounds * 21 + 4)
    res: dict[str, list[float]] = {k: [] for k in steps}
    loads = []
    with torch.inference_mode():
        for _ in range(rounds):
            for label, step in steps.items():
                step()  # warm: this model's weights back in the caches' way
                ts = []
                for _ in range(20):
                    t = time.thread_time()
                    step()
                    ts.append(time.thread_time() - t)
                res[label].append(1e3 * statistics.median(ts))
            loads.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in res.items()}
    (a, b) = HEADS
    print(f"{name}: decode ms/token {a} {med[a]:.2f}, {b} {med[b]:.2f} ({med[b] / med[a]:.3f}x); held weights "
          f"{held[a] / 2**20:.0f} / {held[b] / 2**20:.0f} MiB; rounds {[round(v, 1) for v in res[a]]} / "
          f"{[round(v, 1) for v in res[b]]}; load {min(loads):.1f}-{max(loads):.1f}", flush=True)  # fmt: skip
    return {"model": name, "ms": med, "rounds": res, "held": held, "load": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["granite-h-1b", "lfm2-1.2b"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    retain_freed_memory()  # as `recap serve` does
    torch.set_num_threads(1)
    for name in args.models:
        model_row(name, args.rounds, args.cache_dir)


if __name__ == "__main__":
    main()
