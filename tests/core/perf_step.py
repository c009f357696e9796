"""Per-step scheduler overhead with 256 running decode requests (not a test: `python -m tests.core.perf_step`)."""

from __future__ import annotations

import time

from recap.config import CacheConfig, CacheLayout, SchedulerConfig
from recap.core.fake_executor import FakeExecutor
from recap.core.request import Request
from recap.core.scheduler import Scheduler


def main(num_requests: int = 256, prompt_len: int = 1024, steps: int = 300, kind: str = "hybrid") -> float:
    bs = 16
    layout = CacheLayout(
        block_size=bs,
        num_kv_blocks=1 + num_requests * (prompt_len + steps + 64) // bs,
        num_state_slots=4 * num_requests,
        has_kv=kind != "ssm",
        has_state=kind != "attention",
        state_bytes_per_slot=1 << 20,
        flops_per_token=1e9,
    )
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=16384, max_model_len=1 << 16),
        CacheConfig(block_size=bs, checkpoint_policy="recap"),
        layout,
    )
    ex = FakeExecutor(bs)
    for i in range(num_requests):
        prompt = [i] * 256 + list(range(prompt_len - 256))  # shared tail, distinct head
        sched.add_request(Request(f"r{i}", prompt, max_tokens=10_000, segment_boundaries=(256,)))
    while True:  # prefill everything; stop once a step is all decodes
        out = sched.schedule()
        sched.update_from_output(out, ex.execute(out))
        if out.num_batched_tokens == num_requests and not sched.num_waiting:
            break
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = ex.execute(out)
        t2 = time.perf_counter()
        sched.update_from_output(out, result)
        times.append((t1 - t0) + (time.perf_counter() - t2))
        assert len(out.scheduled) == num_requests
    times.sort()
    median, best = times[len(times) // 2] * 1e3, times[0] * 1e3
    print(f"{kind}: {num_requests} decodes, context {prompt_len}+: median {median:.3f} ms, best {best:.3f} ms per step")
    return median


if __name__ == "__main__":
    for kind in ("hybrid", "attention", "ssm"):
        main(kind=kind)
