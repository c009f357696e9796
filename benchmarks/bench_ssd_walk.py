"""One Mamba2 SSD layer's prefill: the torch op (kernels/ssd.py) against the native walk (kernels/ssd_walk.py).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_ssd_walk.py [--tokens 512] [--heads 48] [--head-dim 64]
        [--groups 1] [--state 128] [--dt-bias -4] [--checkpoint-every 0] [--threads 1] [--reps 9]

Default: the granite-h-1b shape. Random inputs (seed 0), A = -U(0, 3) per head; --dt-bias -4 keeps the decays
gentle (a trained model's), 0 makes many chunk-heads steep (random weights'). --checkpoint-every k writes a
checkpoint slot every k tokens (16: the `all` policy). The two ops alternate rep by rep; wall time, medians. The
largest output and state differences between the two are printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec
from recap.kernels.ssd import ssd
from recap.kernels.ssd_walk import ssd_native
from recap.process.heap import retain_freed_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--dt-bias", type=float, default=-4.0)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    retain_freed_memory()  # as `recap serve` does
    torch.set_num_threads(args.threads)
    t, h, p, g, n = args.tokens, args.heads, args.head_dim, args.groups, args.state
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(t, h, p, generator=gen), torch.randn(t, h, generator=gen)
    b, c = torch.randn(t, g, n, generator=gen), torch.randn(t, g, n, generator=gen)
    a, d = -torch.rand(h, generator=gen) * 3, torch.randn(h, generator=gen)
    bias = torch.full((h,), args.dt_bias)
    every = args.checkpoint_every
    cps = [(q, 2 + i) for i, q in enumerate(range(every, t, every))] if every else []
    meta = build_forward_batch([SeqSpec([0] * t, 0, state_slot=1, checkpoints=cps)], block_size=16, chunk_size=256,
                               with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    ops = {"torch": ssd, "native": ssd_native}
    caches = {k: torch.zeros(2 + len(cps), h, p, n) for k in ops}

    def run(k: str) -> torch.Tensor:
        return ops[k](x, dt, a, b, c, d, bias, True, (0.0, float("inf")), caches[k], meta)

    ys = {k: run(k) for k in ops}
    times: dict[str, list[float]] = {k: [] for k in ops}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for k in ops:
            start = time.perf_counter()
            run(k)
            times[k].append(time.perf_counter() - start)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"T={t} H={h} P={p} G={g} N={n} dt_bias={args.dt_bias} checkpoints={len(cps)} threads={args.threads}: "
          f"torch {med['torch']:.2f} ms, native {med['native']:.2f} ms ({med['torch'] / med['native']:.2f}x); "
          f"max |dy| {(ys['torch'] - ys['native']).abs().max():.2e} (max |y| {ys['torch'].abs().max():.1f}), "
          f"max |dstate| {(caches['torch'] - caches['native']).abs().max():.2e}; "
          f"1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
