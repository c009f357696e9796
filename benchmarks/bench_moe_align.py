"""Speed of the routed experts' pair alignment on a GPU: align_pairs (kernels/moe.py, ~33 torch ops) against
align_pairs_triton (kernels/triton/moe_align.py, one launch), each replayed from a CUDA graph as a decode step
runs it, and eagerly. Checks that both give the same AlignedPairs first.

    .venv/bin/python benchmarks/bench_moe_align.py [--tokens 1 8 64 512 4096] [--experts 8 128 512] [--top-k 8]

Prints per (T, E, k): median us per call over --rounds rounds of --reps calls each, graph and eager, and the
ratio torch / Triton (above 1: the one launch is faster). On a CPU (--device cpu) it runs under the Triton
interpreter with one round of few calls: a check that the script runs, its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from recap.kernels.moe import align_pairs
from recap.kernels.triton.fused_moe import BLOCK_M
from recap.kernels.triton.moe_align import align_pairs_triton, covers


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph (warmed up on a side stream first), returned as its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _median_us(fn: Callable[[], object], dev: str, rounds: int, reps: int) -> float:
    times = []
    for _ in range(rounds):
        if dev == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(times)


def _case(ids: torch.Tensor, num_experts: int, dev: str, rounds: int, reps: int) -> str:
    """Both alignments of `ids` checked equal, then timed: eager, and on a GPU replayed from a graph."""
    want, got = align_pairs(ids, num_experts, BLOCK_M), align_pairs_triton(ids, num_experts, BLOCK_M)
    assert torch.equal(want.pair_ids, got.pair_ids) and torch.equal(want.block_expert, got.block_expert)
    calls = {"torch": partial(align_pairs, ids, num_experts, BLOCK_M),
             "triton": partial(align_pairs_triton, ids, num_experts, BLOCK_M)}  # fmt: skip
    eager = {name: _median_us(fn, dev, rounds, reps) for name, fn in calls.items()}
    line = f"eager torch {eager['torch']:.1f} us, triton {eager['triton']:.1f}"
    if dev == "cuda":
        graph = {name: _median_us(_graphed(fn), dev, rounds, reps) for name, fn in calls.items()}
        line += (f"; graph torch {graph['torch']:.1f} us, triton {graph['triton']:.1f} "
                 f"(torch/triton {graph['torch'] / graph['triton']:.2f})")  # fmt: skip
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 128, 512])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on a CPU run it under TRITON_INTERPRET=1 (its times then mean nothing)")
    rounds, reps = (args.rounds, args.reps) if dev == "cuda" else (1, 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    for tokens in args.tokens:
        for num_experts in args.experts:
            k = min(args.top_k, num_experts)
            if not covers(tokens * k, num_experts):
                print(f"T={tokens} E={num_experts} k={k}: past the one-launch alignment's limits")
                continue
            ids = torch.rand(tokens, num_experts, generator=gen, device=dev).topk(k, dim=-1).indices
            print(f"T={tokens} E={num_experts} k={k}: {_case(ids, num_experts, dev, rounds, reps)}", flush=True)


if __name__ == "__main__":
    main()
