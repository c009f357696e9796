"""Cost model of one engine step, for the replay's simulated clock.

step seconds = step_overhead_s + FLOPs of the batch / flops_per_second, where the FLOPs of a
request's chunk are the model shape's prefill FLOPs of its positions (a decode token is a one-token
chunk). The overhead stands for what a step costs regardless of its tokens (reading the weights once
per step). The defaults model one 4-GPU tensor-parallel instance of H200-class accelerators:
4 x 989 TFLOP/s dense bf16 at ~50% utilisation = 2e15 FLOP/s, and a 7B model's 14 GB of fp16
weights read once per step over 4 x 4.8 TB/s = 0.7 ms, rounded to 1 ms. Serving the whole synthetic
Mooncake trace without any caching then keeps the instance ~40% busy: queueing stays rare, so hit
rates reflect the cache and not an overloaded queue (one H200 alone would fall behind the trace).
"""

from __future__ import annotations

from dataclasses import dataclass

from recap.bench.shapes import ModelShape
from recap.core.output import SchedulerOutput

DEFAULT_FLOPS_PER_SECOND = 2e15
DEFAULT_STEP_OVERHEAD_S = 0.001


@dataclass(frozen=True)
class CostModel:
    shape: ModelShape
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        if self.flops_per_second <= 0:
            raise ValueError("flops_per_second must be positive")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be non-negative")

    def step_flops(self, sched_out: SchedulerOutput) -> float:
        f = self.shape.prefill_flops
        return sum(f(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)) for s in sched_out.scheduled)

    def step_seconds(self, sched_out: SchedulerOutput) -> float:
        return self.step_overhead_s + self.step_flops(sched_out) / self.flops_per_second
