"""Where a speculative verify step's time goes on the CPU, next to a plain decode step (docs/speculative.md).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_verify.py [--k 4] [--rounds 30] [--model PATH]

Model: the embedded default model (or a checkpoint folder), fp32, 1 thread, the CPU backend, batch 1, after a
512-token prompt. Per round, alternating (medians over rounds, so the shared machine's load hits each alike):
- decode: a plain 1-token decode step (the captured decode graph);
- verify graph: a verify row of 1 + k tokens with a state write per draft into a scratch slot (verify_graph.py);
- verify module: the same row through the module path (the reference verify path);
- module, no writes: the same k + 1 tokens as a plain chunk through the module path (what the writes cost);
- batch build: building the verify step's ForwardBatch; rollback: copying one slot's state (every layer).
Each forward is timed alone (the step's logits and verification are the same for both verify paths).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from recap.backends import prepare
from recap.backends.cpu import CpuBackend
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.default_model import ensure_random_model
from recap.model.loader import load_model
from recap.model.testing import forward_step

BLOCK, PROMPT = 16, 512


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint folder (default: the default model)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(args.model or ensure_random_model())
    backend = prepare(lm)
    assert isinstance(backend, CpuBackend)
    model, k = lm.model, args.k
    blocks = list(range(1, 2 + (PROMPT + 64) // BLOCK))
    caches = ModelCaches.allocate(model.config, len(blocks) + 1, BLOCK, 3 + k, model.dtype, zeros=backend.cache_zeros())
    prompt = torch.randint(10, 4000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    forward_step(model, caches, [SeqSpec(prompt, 0, blocks, state_slot=1)], backend)
    pos = PROMPT  # every step rewrites the same positions: the caches' contents do not matter for its time
    row = list(range(7, 8 + k))
    writes = [(pos + 1 + j, 3 + j) for j in range(k)]
    verify = [SeqSpec(row, pos, blocks, state_slot=1, checkpoints=writes)]
    cfg = model.config
    build = lambda: build_forward_batch(verify, block_size=BLOCK, chunk_size=cfg.ssm_chunk_size,  # noqa: E731
                                        with_attention=bool(cfg.full_attention_layers), with_ssm=cfg.has_ssm)
    cases: dict[str, Callable[[], object]] = {
        "decode (graph)": lambda: forward_step(model, caches, [SeqSpec([7], pos, blocks, state_slot=1)], backend),
        f"verify 1+{k} (graph)": lambda: forward_step(model, caches, verify, backend, num_draft_tokens=k),
        f"verify 1+{k} (module path)": lambda: forward_step(model, caches, verify, backend),
        f"{k + 1} tokens, no writes (module path)": lambda: forward_step(
            model, caches, [SeqSpec(row, pos, blocks, state_slot=1)], backend),
        "verify batch build": build,
        "rollback (copy_state)": lambda: caches.copy_state(3, 1),
    }  # fmt: skip
    for fn in cases.values():  # warm-up: the graphs are captured here
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(_timed(fn))
    base = statistics.median(times["decode (graph)"])
    print(f"k={k}, batch 1, {PROMPT}-token context, 1 thread, load {os.getloadavg()[0]:.1f}; medians of {args.rounds}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<34} {1e3 * med:8.3f} ms  (min {1e3 * min(ts):.3f})  {med / base:5.2f}x decode")


if __name__ == "__main__":
    main()
