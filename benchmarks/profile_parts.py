"""Where a recap model step's time goes, by part: linears vs the rest (thread CPU time, 1 thread).

    .venv/bin/python benchmarks/profile_parts.py --model qwen3_5-150m [--modes prefill prefill_ckpt b1 b8]
        [--backend onednn] [--reps 3]

The step is bench_model.py's (ForwardBatch build + forward + last-token logits + greedy argmax): a 2048-token
prefill (prefill_ckpt: with a checkpoint at every 16-token block) or one decode step of batch 1 / 8 after a
128-token prompt. Each part is the CPU time spent inside one set of functions (the outermost one counts when
they nest): linear (every Linear, the head included), gated delta rule (GDN / KDA kernel), attention kernel
(paged / MLA), conv (causal conv1d), norms, routed experts (MoE); "rest" is the step minus the parts (Python
dispatch, embedding, residual adds, activations, gates, metadata, sampling). Medians over --reps runs of each
part. Run bench_model.py first: it builds the checkpoints this script loads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402

from recap.model.layers import conv, gated_attention, gdn, kda, linear, mla, moe, norm  # noqa: E402
from recap.model.loader import load_model  # noqa: E402

PARTS: dict[str, list[tuple[Any, str]]] = {
    "linear": [(linear.Linear, "forward")],
    "gated delta rule": [(gdn, "gated_delta_rule"), (kda, "kda")],
    "attention kernel": [(gated_attention, "paged_attention"), (mla, "paged_mla_attention")],
    "conv": [(conv.CausalConv1d, "forward"), (gdn.GatedDeltaNetMixer, "_conv")],
    "norms": [(norm.RMSNorm, "forward"), (norm.HeadGatedRMSNorm, "forward"), (norm.GatedRMSNorm, "forward")],
    "routed experts": [(moe.StackedExperts, "run"), (moe.ExpertList, "run")],
}


def instrument() -> dict[str, float]:
    """Wrap every part's functions; returns the dict they add their CPU seconds to."""
    acc: dict[str, float] = {}
    depth = [0]

    def timed(fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] = acc.get(part, 0.0) + time.thread_time() - t
                depth[0] -= 1

        return run

    for part, targets in PARTS.items():
        for owner, name in targets:
            setattr(owner, name, timed(getattr(owner, name), part))
    return acc


def measure(engine: bench_model.RecapEngine, mode: str, acc: dict[str, float]) -> dict[str, float]:
    """CPU seconds of one step of `mode` and of each part in it."""
    if mode.startswith("prefill"):
        acc.clear()
        total = engine.prefill(every_block=mode == "prefill_ckpt")
        return {"step": total, **acc}
    batch = int(mode[1:])
    acc.clear()  # the parts of 12 steps minus those of 2 steps (same prompts): 10 steps, per step
    total = engine.decode(batch, 12)
    long = dict(acc)
    acc.clear()
    engine.decode(batch, 2)
    return {"step": total, **{k: (v - acc.get(k, 0.0)) / 10 for k, v in long.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_5-150m")
    ap.add_argument("--modes", nargs="+", default=["prefill", "prefill_ckpt", "b1", "b8"])
    ap.add_argument("--backend", default="onednn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "recap" / "bench-models")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench_model._now = time.thread_time
    acc = instrument()
    lm = load_model(bench_model.build_checkpoint(args.model, args.cache_dir / args.model), torch.float32)
    engine = bench_model.RecapEngine(lm.model, args.backend)
    load = os.getloadavg()[0]
    for mode in args.modes:
        measure(engine, mode, acc)  # warm-up
        runs = [measure(engine, mode, acc) for _ in range(args.reps)]
        med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        step = med.pop("step")
        parts = sorted(med.items(), key=lambda kv: -kv[1])
        rest = step - sum(med.values())
        shown = "  ".join(f"{k} {1e3 * v:.1f} ({100 * v / step:.0f}%)" for k, v in parts if v > 0)
        tail = f"rest {1e3 * rest:.1f} ({100 * rest / step:.0f}%)"
        print(f"{args.model} {mode}: step {1e3 * step:.1f} ms = {shown}  {tail}")
    print(f"thread CPU time, 1 thread, {args.backend} linears, medians of {args.reps}; "
          f"1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
