"""Decode tokens/s with async scheduling off and on (SchedulerConfig.async_scheduling), side by side.

    nice -n 5 python benchmarks/bench_async_scheduling.py --batch 1 32 --steps 200 --repeats 5 [--policy recap]

The real engine (LLMEngine.step) decodes greedily on host_step.py's tiny random Nemotron-H-like checkpoint (hidden
64, vocab 512), torch threads 1, device CPU: the forward is cheap, so host work is most of a step. Each repeat times
`steps` engine steps of `batch` decoding requests (prefilled first) and counts the tokens they returned; the two
modes alternate repeat by repeat so load drift hits both. Prints medians of tokens/s per mode and their ratio, the
tokens per step and request with async on (below 1 where a request waited a step at a block end while the state
group plans checkpoints: core/async_scheduling.py) and the 1-minute load average, then one JSON line.

On a CPU the model and the host share one thread: scheduling ahead changes the order of the same work, not its
amount, so little gain is expected here; the overlap pays where the forward runs on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.host_step import build_model  # noqa: E402
from recap.config import CacheConfig, SchedulerConfig  # noqa: E402
from recap.engine.config import EngineConfig  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.sampling_params import SamplingParams  # noqa: E402


def make_engine(path: Path, batch: int, async_on: bool, policy: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), device="cpu", kernels="torch", dtype="float32", seed=0, generation_config="vllm",
        num_threads=1, cache=CacheConfig(block_size=16, kv_cache_bytes=64 << 20, state_cache_bytes=64 << 20,
                                         checkpoint_policy=policy),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_model_len=4096, max_num_batched_tokens=2048,
                                  async_scheduling=async_on),
    ))  # fmt: skip


def start(engine: LLMEngine, batch: int, max_tokens: int, prompt: int) -> None:
    """Add `batch` greedy requests and step until each has its first token (prefills done)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 500, (prompt,), generator=g).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(r.request_id for r in engine.step() if r.outputs[0].token_ids)


def timed_steps(engine: LLMEngine, steps: int) -> tuple[float, int]:
    """(seconds, tokens returned) over `steps` engine steps."""
    seen = {rid: len(p.children) for rid, p in engine.outputs.parents.items()}
    before = sum(len(c.output.token_ids) for p in engine.outputs.parents.values() for c in p.children.values())
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    after = sum(len(c.output.token_ids) for p in engine.outputs.parents.values() for c in p.children.values())
    assert seen == {rid: len(p.children) for rid, p in engine.outputs.parents.items()}, "a request finished"
    return wall, after - before


def measure(path: Path, batch: int, steps: int, repeats: int, prompt: int, policy: str) -> dict[str, Any]:
    engines = {mode: make_engine(path, batch, mode, policy) for mode in (False, True)}
    for e in engines.values():
        start(e, batch, (repeats + 2) * steps + 8, prompt)
        timed_steps(e, 10)  # warm-up
    rates: dict[bool, list[float]] = {False: [], True: []}
    per_step: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for mode, e in engines.items():
            wall, tokens = timed_steps(e, steps)
            rates[mode].append(tokens / wall)
            per_step[mode].append(tokens / steps / batch)
    off, on = (statistics.median(rates[m]) for m in (False, True))
    # under async scheduling a request whose next token ends a block waits a step while checkpoints are planned
    return {"batch": batch, "tok_s_off": off, "tok_s_on": on, "ratio": on / off,
            "tokens_per_step_on": statistics.median(per_step[True])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens per request")
    ap.add_argument("--policy", default="recap", help="checkpoint policy (none: no step waits at block ends)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp))
        rows = [measure(path, b, args.steps, args.repeats, args.prompt, args.policy) for b in args.batch]
    load = os.getloadavg()[0]
    print(f"decode tok/s, medians of {args.repeats} x {args.steps} steps, policy {args.policy}, torch threads 1, "
          f"load average {load:.2f}")  # fmt: skip
    print(f"{'batch':>5} {'off':>10} {'on':>10} {'on/off':>7} {'on: tokens/step/request':>24}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tok_s_off']:>10.0f} {r['tok_s_on']:>10.0f} {r['ratio']:>7.3f} "
              f"{r['tokens_per_step_on']:>24.3f}")  # fmt: skip
    print(json.dumps({"bench": "async_scheduling", "policy": args.policy, "load_avg_1m": load, "rows": rows}))


if __name__ == "__main__":
    main()
