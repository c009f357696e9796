"""The CPU backend's native prefill kernels against the torch ops they stand in for, inside a real-shape model step.

    .venv/bin/python benchmarks/bench_prefill_ops.py [--models qwen3_5-0.8b lfm2-1.2b granite-h-1b] [--format int4]
        [--tokens 512] [--reps 5] [--threads 1] [--swap causal_conv1d gated_delta_rule kda ssd]

Each model (benchmarks/real_shapes.py's checkpoints, built on first use) loads once on the CPU backend
(recap/backends/cpu.py); its kernel set is then swapped step by step between CPU_KERNELS (the native conv taps,
gated delta rule, KDA and SSD: kernels/cpu_kernel_set.py) and the same set with the torch ops (conv1d.causal_conv1d,
gdn.gated_delta_rule, kda.kda, ssd.ssd) in the place of those named by --swap (default all), alternating within
each rep so load hits both alike. A step is
peers_real.py's prefill (one --tokens-token prompt from an empty state, the last token's logits). Per op, the
thread CPU time summed over the model's layers; per step, wall time. Medians over --reps.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_real import RECAP_FORMATS  # noqa: E402
from real_shapes import build_checkpoint  # noqa: E402

from recap.backends import prepare  # noqa: E402
from recap.kernels.conv1d import causal_conv1d  # noqa: E402
from recap.kernels.cpu_kernel_set import CPU_KERNELS  # noqa: E402
from recap.kernels.gdn import gated_delta_rule  # noqa: E402
from recap.kernels.kda import kda  # noqa: E402
from recap.kernels.kernel_set import KernelSet  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.kernels.ssd import ssd  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step  # noqa: E402
from recap.process.heap import retain_freed_memory  # noqa: E402

TORCH_OPS = {"causal_conv1d": causal_conv1d, "gated_delta_rule": gated_delta_rule, "kda": kda, "ssd": ssd}
OPS = tuple(TORCH_OPS)


def timed(kernels: KernelSet, spent: dict[str, float]) -> KernelSet:
    """`kernels` with each of OPS adding its thread CPU time to spent[op]."""

    def wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                spent[op] += time.thread_time() - t

        return run

    return dataclasses.replace(kernels, **{op: wrap(op, getattr(kernels, op)) for op in OPS})


def bench(name: str, fmt: str, tokens: int, reps: int, swap: list[str]) -> list[dict[str, Any]]:
    quant, head = RECAP_FORMATS[fmt]
    lm = load_model(build_checkpoint(name), quantization=quant, head_quantization=head)
    backend, model = prepare(lm), lm.model
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(1, 1 + tokens // 16))
    torch_ops = dataclasses.replace(CPU_KERNELS, name="cpu+torch ops", **{op: TORCH_OPS[op] for op in swap})
    sets = {"torch ops": torch_ops, "native": CPU_KERNELS}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in sets}
    for rep in range(reps + 1):  # the first round warms both up
        for label, kernels in sets.items():
            spent = dict.fromkeys(OPS, 0.0)
            backend.kernels = timed(kernels, spent)
            caches = ModelCaches.allocate(model.config, len(blocks) + 1, 16, 2, model.dtype)
            t = time.perf_counter()
            hidden, batch = forward_step(model, caches, [SeqSpec(ids, 0, blocks, state_slot=1)], backend)
            model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
            wall = time.perf_counter() - t
            if rep:
                samples[label].append({"step_ms": 1e3 * wall, **{op: 1e3 * s for op, s in spent.items()}})
    rows = []
    for label, runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"model": name, "kernels": label, "tok_s": tokens / med["step_ms"] * 1e3, **med})
    backend.kernels = CPU_KERNELS
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3_5-0.8b", "lfm2-1.2b", "granite-h-1b"])
    ap.add_argument("--format", default="int4", choices=list(RECAP_FORMATS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--swap", nargs="+", default=list(OPS), choices=OPS, help="the ops the torch side runs in torch")
    args = ap.parse_args()
    retain_freed_memory()  # as `recap serve` does: a step's large temporaries reuse the heap, not fresh pages
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    rows = [r for name in args.models for r in bench(name, args.format, args.tokens, args.reps, args.swap)]
    load.append(os.getloadavg()[0])
    print(f"{args.format}, {args.tokens}-token prefill, {args.threads} threads, medians of {args.reps} (alternating); "
          f"torch side: {' '.join(args.swap)}; 1-min load {load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
    print(f"{'model':<14} {'kernels':<10} {'tok/s':>7} {'step ms':>8} {'conv ms':>8} {'GDN ms':>8} {'KDA ms':>7} "
          f"{'SSD ms':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['model']:<14} {r['kernels']:<10} {r['tok_s']:>7.1f} {r['step_ms']:>8.1f} {r['causal_conv1d']:>8.1f} "
              f"{r['gated_delta_rule']:>8.1f} {r['kda']:>7.1f} {r['ssd']:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
