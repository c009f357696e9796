"""The gated delta rule kernel alone: per-token reference vs the fast path, prefill and decode shapes.

    .venv/bin/python benchmarks/bench_gated_delta.py [--threads 1] [--reps 5] [--pieces 16 32 64]
        [--out bench_out/bench_gated_delta.json]
    .venv/bin/python benchmarks/bench_gated_delta.py --ab [--threads 1] [--reps 7] [--kernels gdn kda qwen3_5-0.8b]

Shapes (fp32, random L2-normalised q/k, seeded):
- gdn: the qwen3_5-150m GDN layer (8 key heads x 64, 16 value heads x 64, one decay per head);
- kda: the kimi-linear-150m KDA layer (6 heads x 128, one decay per key channel);
- qwen3_5-0.8b: the Qwen3.5-0.8B GDN layer (16 key and 16 value heads x 128, one decay per head).
Prefill: one 2048-token row from a zero state, without checkpoints and with one at every 16-token block
(128 states written to their slots); the fast path at each --pieces size. Decode: one token per row for
batch 1 and 8 on consecutive slots (the in-place path) and on scattered slots. The reference
(gated_delta_rule_ref / gated_delta_rule_update_ref: a Python loop per token / per row and head) runs
once per shape (it is slow); the fast path --reps times. Medians of thread CPU time (needs --threads 1 to be
the work itself) and the 1-minute load average are printed.
--ab: the torch chunk form (gdn.gated_delta_rule) against the native one (gdn_walk.gated_delta_rule_native, the CPU
backend's) on the prefill shapes, the two alternating rep by rep (the machine's load hits both alike): medians and
their ratio, with the q/k norms inside each (normalize_qk, as the GDN layer calls them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recap.bench.timing import timings
from recap.kernels.batch import build_forward_batch
from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update, gated_delta_rule_update_ref
from recap.kernels.gdn_walk import gated_delta_rule_native
from recap.kernels.metadata import SeqSpec, SSMMetadata

# hk, hv, dk, dv, per-channel decay
SHAPES = {"gdn": (8, 16, 64, 64, False), "kda": (6, 6, 128, 128, True), "qwen3_5-0.8b": (16, 16, 128, 128, False)}
PREFILL, BLOCK = 2048, 16


def _inputs(shape: tuple, t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    hk, hv, dk, dv, per_channel = shape
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, hk, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(t, hk, dk, generator=gen))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, *((dk,) if per_channel else ()), generator=gen) * 0.5
    beta = torch.rand(t, hv, generator=gen)
    return q, k, v, g, beta


def _time(fn: Callable[[], Any], reps: int, warm: bool = True) -> float:
    return statistics.median(timings(fn, reps, warm=warm))


def _prefill_meta(tokens: int, ckpt: bool) -> tuple[SSMMetadata, int]:
    """One `tokens`-token row's metadata (running slot 1; with `ckpt`, a checkpoint every BLOCK tokens in slots 2..),
    and the number of state slots it needs."""
    cps = [(p, 2 + i) for i, p in enumerate(range(BLOCK, tokens + 1, BLOCK))] if ckpt else []
    spec = SeqSpec([0] * tokens, 0, state_slot=1, checkpoints=cps)
    meta = build_forward_batch([spec], block_size=BLOCK, chunk_size=64, with_attention=False, with_ssm=True).ssm
    assert meta is not None
    return meta, 2 + len(cps)


def prefill_rows(name: str, reps: int, pieces: list[int]) -> list[dict[str, Any]]:
    shape = SHAPES[name]
    args = _inputs(shape, PREFILL)
    rows = []
    for ckpt in (False, True):
        meta, slots = _prefill_meta(PREFILL, ckpt)
        state = torch.zeros(slots, shape[1], shape[2], shape[3])
        ref_state = state.clone()
        t0 = time.thread_time()
        y_ref = gated_delta_rule_ref(*args, ref_state, meta)
        t_ref = time.thread_time() - t0
        for piece in pieces:
            y = gated_delta_rule(*args, state, meta, piece=piece)
            err = max(float((y - y_ref).abs().max()), float((state - ref_state).abs().max()))
            t = _time(lambda: gated_delta_rule(*args, state, meta, piece=piece), reps)  # noqa: B023
            rows.append({"kernel": name, "shape": f"prefill {PREFILL}" + (" +ckpt/16" if ckpt else ""),
                         "piece": piece, "ref_ms": 1e3 * t_ref, "fast_ms": 1e3 * t, "max_abs_err": err})  # fmt: skip
    return rows


def decode_rows(name: str, reps: int) -> list[dict[str, Any]]:
    shape = SHAPES[name]
    rows = []
    for b in (1, 8):
        for layout in ("consecutive", "scattered"):
            q, k, v, g, beta = _inputs(shape, b, seed=b)
            slots = torch.arange(1, b + 1) if layout == "consecutive" else torch.arange(1, 2 * b + 1, 2)
            state = torch.randn(2 * b + 2, shape[1], shape[2], shape[3]) * 0.1
            ref_state = state.clone()
            y_ref = gated_delta_rule_update_ref(ref_state, q, k, v, g, beta, slots)
            y = gated_delta_rule_update(state, q, k, v, g, beta, slots)
            err = max(float((y - y_ref).abs().max()), float((state - ref_state).abs().max()))
            t_ref = _time(lambda: gated_delta_rule_update_ref(ref_state, q, k, v, g, beta, slots), 2)  # noqa: B023
            t = _time(lambda: gated_delta_rule_update(state, q, k, v, g, beta, slots), reps * 20)  # noqa: B023
            rows.append({"kernel": name, "shape": f"decode b{b} {layout}", "piece": None, "ref_ms": 1e3 * t_ref,
                         "fast_ms": 1e3 * t, "max_abs_err": err})  # fmt: skip
    return rows


def ab_rows(name: str, reps: int, tokens: int) -> list[dict[str, Any]]:
    """The torch chunk form vs the native kernel on one `tokens`-token row, alternating; without checkpoints and
    with one every BLOCK tokens."""
    shape = SHAPES[name]
    args = _inputs(shape, tokens)
    rows = []
    for ckpt in (False, True):
        meta, slots = _prefill_meta(tokens, ckpt)
        states = [torch.zeros(slots, shape[1], shape[2], shape[3]) for _ in range(2)]
        fns = (gated_delta_rule, gated_delta_rule_native)
        ys = [fn(*args, s, meta, normalize_qk=True) for fn, s in zip(fns, states)]  # warm, and the error
        err = max(float((ys[0] - ys[1]).abs().max()), float((states[0] - states[1]).abs().max()))
        times: list[list[float]] = [[], []]
        for _ in range(reps):
            for i, (fn, s) in enumerate(zip(fns, states)):
                t0 = time.thread_time()
                fn(*args, s, meta, normalize_qk=True)
                times[i].append(time.thread_time() - t0)
        torch_ms, native_ms = (1e3 * statistics.median(t) for t in times)
        rows.append({"kernel": name, "shape": f"prefill {tokens}" + (f" +ckpt/{BLOCK}" if ckpt else ""),
                     "torch_ms": torch_ms, "native_ms": native_ms, "max_abs_diff": err})  # fmt: skip
    return rows


def main_ab(args: argparse.Namespace) -> None:
    load = [os.getloadavg()[0]]
    rows = [r for name in args.kernels for t in args.tokens for r in ab_rows(name, args.reps, t)]
    load.append(os.getloadavg()[0])
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, thread CPU time, torch and native alternating, "
          f"medians of {args.reps}; 1-min load {load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
    print(f"{'kernel':<13} {'shape':<26} {'torch ms':>9} {'native ms':>10} {'speed-up':>9} {'max diff':>9}")
    for r in rows:
        print(f"{r['kernel']:<13} {r['shape']:<26} {r['torch_ms']:>9.2f} {r['native_ms']:>10.2f} "
              f"{r['torch_ms'] / r['native_ms']:>8.2f}x {r['max_abs_diff']:>9.1e}")  # fmt: skip
    out = args.out.with_name(args.out.stem + "_ab.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "load_avg_1min": load, "rows": rows}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", nargs="+", choices=list(SHAPES), help="default: gdn kda (--ab: all three)")
    ap.add_argument("--pieces", nargs="+", type=int, default=[16, 32, 64], help="fast-path piece sizes (tokens)")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "bench_gated_delta.json")
    ap.add_argument("--ab", action="store_true", help="torch chunk form vs the native kernel, alternating")
    ap.add_argument("--tokens", nargs="+", type=int, default=[512, PREFILL], help="--ab: prefill lengths")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ab:
        args.kernels = args.kernels or list(SHAPES)
        main_ab(args)
        return
    args.kernels = args.kernels or ["gdn", "kda"]
    load = [os.getloadavg()[0]]
    rows = []
    for name in args.kernels:
        rows += prefill_rows(name, args.reps, args.pieces) + decode_rows(name, args.reps)
    load.append(os.getloadavg()[0])
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, thread CPU time, medians of {args.reps}; "
          f"1-min load {load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
    head = f"{'kernel':<6} {'shape':<26} {'piece':>5} {'reference ms':>13} {'fast ms':>9} {'speed-up':>9}"
    print(f"{head} {'max err':>9}")
    for r in rows:
        piece = "" if r["piece"] is None else str(r["piece"])
        print(f"{r['kernel']:<6} {r['shape']:<26} {piece:>5} {r['ref_ms']:>13.2f} {r['fast_ms']:>9.3f} "
              f"{r['ref_ms'] / r['fast_ms']:>8.1f}x {r['max_abs_err']:>9.1e}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "load_avg_1min": load, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
