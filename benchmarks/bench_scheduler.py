"""Cache-core overhead per step: schedule() + update_from_output() with N running decodes.

The model does nothing (FakeExecutor, timed apart), so the figure is the engine's bookkeeping that a
GPU step has to hide: token budgets, block tables, checkpoint plans and their registration (the
decode-end snapshot of every request that crosses a block boundary). Target: <= 1 ms at 256 decodes.

    python benchmarks/bench_scheduler.py --running 256 --steps 300 [--policy recap] [--json-out FILE]

Prints a table of median / p90 per-step times for schedule, execute (fake) and update, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from recap.bench.shapes import get_shape
from recap.config import CacheConfig, SchedulerConfig
from recap.core.fake_executor import FakeExecutor
from recap.core.request import Request
from recap.core.scheduler import Scheduler


def measure(running: int, steps: int, policy: str, prompt_len: int, block_size: int, seed: int) -> dict:
    shape = get_shape("hybrid-7b")
    tokens_needed = running * (prompt_len + 4 * steps + 128)
    layout = shape.layout(block_size, tokens_needed // block_size + running + 1, 2 * running + 512)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=8192, max_model_len=prompt_len + 4 * steps + 128),
        CacheConfig(block_size=block_size, checkpoint_policy=policy),
        layout,
    )
    executor = FakeExecutor(block_size=block_size, seed=seed)
    for i in range(running):
        # Three requests in four share a prefix (up to 512 tokens): hits, branch points, tails.
        shared = list(range(min(512, prompt_len // 2))) if i % 4 else []
        tail = [(seed * 7919 + i * 104_729 + j) % 32_000 for j in range(prompt_len - len(shared))]
        sched.add_request(Request(str(i), shared + tail, max_tokens=4 * steps + 64))
    requests = [sched.get_request(str(i)) for i in range(running)]
    while sched.num_waiting or any(r is not None and r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        out = sched.schedule()
        sched.update_from_output(out, executor.execute(out))  # prefill: not timed
    t_sched, t_exec, t_update = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = executor.execute(out)
        t2 = time.perf_counter()
        sched.update_from_output(out, result)
        t3 = time.perf_counter()
        assert len(out.scheduled) == running, f"{len(out.scheduled)} of {running} requests decoding"
        t_sched.append(t1 - t0)
        t_exec.append(t2 - t1)
        t_update.append(t3 - t2)
    both = [a + b for a, b in zip(t_sched, t_update, strict=True)]

    def ms(xs: list[float], q: float) -> float:
        return 1e3 * (statistics.median(xs) if q == 0.5 else sorted(xs)[int(q * (len(xs) - 1))])

    return {
        "running": running,
        "policy": policy,
        "steps": steps,
        "schedule_ms_median": ms(t_sched, 0.5),
        "update_ms_median": ms(t_update, 0.5),
        "schedule_plus_update_ms_median": ms(both, 0.5),
        "schedule_plus_update_ms_p90": ms(both, 0.9),
        "fake_execute_ms_median": ms(t_exec, 0.5),
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--policy", default="recap")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = [measure(n, args.steps, args.policy, args.prompt_len, args.block_size, args.seed) for n in args.running]
    print("| running | schedule ms | update ms | schedule+update ms (median) | p90 | fake execute ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['running']} | {r['schedule_ms_median']:.3f} | {r['update_ms_median']:.3f} | "
            f"**{r['schedule_plus_update_ms_median']:.3f}** | {r['schedule_plus_update_ms_p90']:.3f} | "
            f"{r['fake_execute_ms_median']:.3f} |"
        )
    line = json.dumps({"policy": args.policy, "results": rows})
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
