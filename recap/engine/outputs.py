"""What the engine returns for a request: cumulative text and tokens plus the latest delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """vLLM's shape: one candidate token's logprob, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob} holding the sampled token and the top-k (vLLM's shape).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token, the same; None for the first (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # What this output added since the previous RequestOutput (for streaming).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: SampleLogprobs = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(d[t].logprob for d, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # The error is the engine's (a step that raised, core/step_faults.py), not the request's: a 500, not a 400.
    internal_error: bool = False
    # Prefill role of a disaggregated deployment: the handle a decode instance pulls the KV with.
    kv_transfer_params: dict[str, Any] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (complete once the prompt is computed).
    prompt_logprobs: PromptLogprobs | None = None
