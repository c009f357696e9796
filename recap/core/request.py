"""A request as the scheduler sees it: token ids, limits and progress. Torch-free."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # Decode side of a disaggregated deployment: the prompt was computed elsewhere; its KV blocks and
    # state are being received (recap.core.transfer).
    WAITING_FOR_REMOTE_KV = 7
    # Its hit is deeper in a lower cache tier (disk): the runner is loading those entries (recap.core.tiers).
    WAITING_FOR_TIER = 8

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence to run. `n > 1` is handled above the core by forking requests."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: number of tokens to generate at most
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # Token offsets the API layer knows are segment ends (chat message ends, client markers).
    segment_boundaries: tuple[int, ...] = ()
    cache_salt: str | None = None
    # Anything else that changes the computation (adapter id, multimodal ids); part of every block hash.
    extra_keys: tuple[Any, ...] = ()
    # Opaque to the core; carried to the runner (a recap.SamplingParams).
    sampling_params: Any = None
    # The runner reports the logprob of every prompt token: the whole prompt is computed, so no prefix
    # hit is read for it (as vLLM does); its blocks and checkpoints are still registered for others.
    prompt_logprobs: bool = False
    # Its decode steps may carry drafts (speculative decoding): greedy sampling of the raw logits, so a draft is
    # accepted exactly when it is the argmax (the engine decides from the sampling settings).
    speculate: bool = False
    # Its sampler reads its output history (penalties) or a grammar matcher does: under async scheduling a step
    # is never scheduled before its previous token is on the host (core/async_scheduling.py).
    host_tokens: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens served from the prefix cache when first scheduled (-1 before that).
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # A step it ran in failed (core/step_faults.py): a suspect until it computes this many tokens; 0: none.
    suspect_until: int = 0
    # Chained hashes of the full token blocks known so far (prompt + outputs), extended by the scheduler
    # as tokens arrive (recap.core.hashing). Empty when prefix caching is off.
    block_hashes: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at absolute positions [start, end) without concatenating prompt and outputs."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
