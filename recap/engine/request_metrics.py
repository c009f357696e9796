"""Per-request latency and size histograms, as vLLM records them: queue, prefill, decode, inference and
end-to-end time, inter-token latency and time per output token, prompt/generation tokens per request,
the n and max_tokens parameters, and tokens per engine step.

Recorded by the engine thread (under EngineMetrics' lock); copied for snapshots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from recap.engine.histogram import Histogram

# vLLM's bucket bounds, so dashboards built on them read the same quantiles.
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class RequestHistograms:
    max_model_len: int
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    step_tokens: Histogram = field(default_factory=lambda: Histogram(STEP_TOKEN_BUCKETS))
    params_n: Histogram = field(default_factory=lambda: Histogram(N_BUCKETS))
    prompt_tokens: Histogram = field(init=False)
    generation_tokens: Histogram = field(init=False)
    params_max_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        bounds = tuple(float(b) for b in one_two_five(self.max_model_len))
        self.prompt_tokens = Histogram(bounds)
        self.generation_tokens = Histogram(bounds)
        self.params_max_tokens = Histogram(bounds)

    def observe_finished(
        self, *, arrival: float, scheduled: float | None, first_token: float | None, finished: float,
        prompt_tokens: int, generation_tokens: int, n: int, max_tokens: int,
    ) -> None:
        """One finished request. A request aborted before it ran has no queue/prefill/decode phases."""
        self.e2e.observe(finished - arrival)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        if scheduled is None:
            return
        self.queue.observe(scheduled - arrival)
        self.inference.observe(finished - scheduled)
        if first_token is None:
            return
        self.prefill.observe(first_token - scheduled)
        self.decode.observe(finished - first_token)
        if generation_tokens > 1:
            self.time_per_output_token.observe((finished - first_token) / (generation_tokens - 1))

    def copy(self) -> RequestHistograms:
        """A snapshot (taken every engine step: plain list copies, no deepcopy)."""
        out = copy.copy(self)
        for f in fields(self):
            h = getattr(self, f.name)
            if isinstance(h, Histogram):
                setattr(out, f.name, Histogram(h.bounds, list(h.counts), h.total, h.n))
        return out
