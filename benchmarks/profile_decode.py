"""Where a recap decode step goes: ATen op counts and self-CPU shares (torch.profiler), and wall ms per step.

    .venv/bin/python benchmarks/profile_decode.py --model mamba2-115m --batch 1 --threads 1 [--dtype float32]
        [--quant int8] [--enforce-eager] [--backend onednn]

The step is the engine's: ForwardBatch build + model forward + logits + greedy sample, after a 128-token
prompt. Op counts do not depend on machine load, so they are the figure to compare on a shared machine;
the 1-minute load average is printed with the wall times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402

from recap.backends import Backend, prepare  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step  # noqa: E402

BLOCK, PROMPT = 16, 128


def decoder(model, backend: Backend, batch: int, steps: int):  # type: ignore[no-untyped-def]
    """A closure running one greedy decode step of `batch` rows per call through `backend` (the prompts
    prefilled first)."""
    per_seq = (PROMPT + steps + 2) // BLOCK + 1
    caches = ModelCaches.allocate(model.config, 1 + batch * per_seq, BLOCK, batch + 1, model.dtype,
                                  zeros=backend.cache_zeros())  # as the engine's runner does
    prompts = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
    tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(batch)]
    specs = [SeqSpec(prompts[r].tolist(), 0, tables[r], state_slot=r + 1) for r in range(batch)]
    hidden, fb = forward_step(model, caches, specs, backend)
    state = {"nxt": model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist(), "pos": PROMPT}

    def step() -> None:
        specs = [SeqSpec([state["nxt"][r]], state["pos"], tables[r], state_slot=r + 1) for r in range(batch)]
        hidden, fb = forward_step(model, caches, specs, backend)
        state["nxt"] = model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist()
        state["pos"] += 1

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mamba2-115m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default=None, help="weight quantization (see recap.model.quant)")
    ap.add_argument("--enforce-eager", action="store_true", help="torch's kernels only (no native decode kernels)")
    ap.add_argument("--backend", default=None, help="linear backend (torch, onednn); default: the loader's")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = {"quantization": args.quant} if args.quant else {}
    kw |= {"native_decode": False} if args.enforce_eager else {}
    kw |= {"linear_backend": args.backend} if args.backend else {}
    path = args.cache_dir / args.model  # a real-shape checkpoint (real_shapes.py) is there already
    path = path if (path / "config.json").exists() else build_checkpoint(args.model, path)
    lm = load_model(path, getattr(torch, args.dtype), **kw)
    backend = prepare(lm)  # as the engine's runner does
    print(f"backend {backend.name}, linear backend {lm.linear_backend}")
    step = decoder(lm.model, backend, args.batch, args.steps + 12)
    for _ in range(5):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = prof.key_averages()
    total_ops = sum(e.count for e in events if e.key.startswith("aten::")) / 5
    print(f"{args.model} batch {args.batch}: {total_ops:.0f} ATen op calls per step (nested included)")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':<42} {'calls/step':>10} {'self %':>7}")
    for e in top:
        print(f"{e.key:<42} {e.count / 5:>10.0f} {100 * e.self_cpu_time_total / total:>6.1f}%")
    counts = Counter({e.key: e.count / 5 for e in events})
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    print(
        f"wall: median {1e3 * statistics.median(times):.2f} ms/step, min {1e3 * min(times):.2f} "
        f"({args.threads} threads, 1-min load {os.getloadavg()[0]:.2f}); top-level ops {sum(counts.values()):.0f}"
    )


if __name__ == "__main__":
    main()
