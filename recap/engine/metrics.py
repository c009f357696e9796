"""Engine-side metrics: counters and a TTFT histogram, read by the server's Prometheus collector."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from recap.core.speculation import SpecCounters
from recap.core.stats import SchedulerStats
from recap.core.tier_index import TierCounters
from recap.engine.histogram import Histogram
from recap.engine.request_metrics import RequestHistograms

FINISHED_REASONS = ("stop", "length", "abort", "error")


def request_finish_reason(choice_reasons: list[str | None]) -> str:
    """One reason for a request whose n choices ended with these: abort, then error, then length, else stop."""
    for reason in ("abort", "error", "length"):
        if reason in choice_reasons:
            return reason
    return "stop"


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class MetricsSnapshot:
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which served from the cache
    checkpoints: int  # registered checkpoints now
    checkpoint_bytes: int
    checkpoints_created: int
    checkpoint_evictions: int
    checkpoint_miss_tokens: int  # KV matched past the best checkpoint (lost to the state group)
    preemptions: int
    num_running: int
    num_waiting: int
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    step_time_total: float
    ttft: Histogram
    # vLLM's per-request histograms and pool usage (recap.engine.request_metrics); None before any engine ran.
    requests: RequestHistograms | None = None
    kv_cache_usage: float = 0.0
    # Finished requests (one per prompt) by reason: stop, length, abort, error (vLLM's finished_reason label).
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (vLLM's spec_decode counters): the scheduler's, as of this snapshot.
    spec: SpecCounters = field(default_factory=SpecCounters)
    # The disk tier (docs/tiers.md): the core's entries, bytes and counters, and the files the store rejected.
    tier_entries: int = 0
    tier_bytes: int = 0
    tier: TierCounters = field(default_factory=TierCounters)
    tier_rejected_files: int = 0
    # The host-memory tier: the core's entries, bytes and counters.
    host_tier_entries: int = 0
    host_tier_bytes: int = 0
    host_tier: TierCounters = field(default_factory=TierCounters)
    # Steps the runner raised on (core/step_faults.py) and the requests they put under suspicion.
    failed_steps: int = 0
    step_suspects: int = 0

    @property
    def offload_load_bytes(self) -> int:
        """Bytes promoted from any lower tier into the read pools (vLLM's kv_offload_load_bytes)."""
        return self.tier.loaded_bytes + self.host_tier.loaded_bytes

    @property
    def offload_store_bytes(self) -> int:
        """Bytes saved from the read pools into a lower tier (vLLM's kv_offload_store_bytes)."""
        return self.tier.stored_bytes + self.host_tier.stored_bytes


class EngineMetrics:
    """Collected by the engine thread; snapshots are safe to take from any thread."""

    def __init__(self, window: int = 4096, max_model_len: int = 4096) -> None:
        self._lock = threading.Lock()
        self.requests = RequestHistograms(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.recent_ttft: deque[float] = deque(maxlen=window)
        self.recent_step_times: deque[float] = deque(maxlen=window)
        self.requests_finished = 0
        self.finished_by_reason: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.step_time_total = 0.0

    def observe_step(self, seconds: float, new_tokens: int) -> None:
        with self._lock:
            self.steps += 1
            self.step_time_total += seconds
            self.generation_tokens += new_tokens
            self.recent_step_times.append(seconds)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)
            self.recent_ttft.append(seconds)

    def observe_finished(self, prompt_tokens: int, reason: str = "stop") -> None:
        with self._lock:
            self.requests_finished += 1
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens

    def observe_request(self, **kw: Any) -> None:
        with self._lock:
            self.requests.observe_finished(**kw)

    def observe_inter_token(self, gaps: list[float], step_tokens: int) -> None:
        with self._lock:
            for g in gaps:
                self.requests.inter_token.observe(g)
            if step_tokens:
                self.requests.step_tokens.observe(step_tokens)

    def snapshot(
        self, stats: SchedulerStats, num_running: int, num_waiting: int, kv_cache_usage: float = 0.0,
        tier_rejected_files: int = 0,
    ) -> MetricsSnapshot:
        with self._lock:
            ttft = Histogram(self.ttft.bounds, list(self.ttft.counts), self.ttft.total, self.ttft.n)
            return MetricsSnapshot(
                prefix_cache_queries=stats.prefix_cache_queries,
                prefix_cache_hits=stats.prefix_cache_hits,
                checkpoints=stats.checkpoints,
                checkpoint_bytes=stats.checkpoint_bytes,
                checkpoints_created=stats.checkpoints_created,
                checkpoint_evictions=stats.checkpoints_evicted,
                checkpoint_miss_tokens=stats.checkpoint_miss_tokens,
                preemptions=stats.preemptions,
                failed_steps=stats.failed_steps,
                step_suspects=stats.step_suspects,
                num_running=num_running,
                num_waiting=num_waiting,
                requests_finished=self.requests_finished,
                prompt_tokens=self.prompt_tokens,
                generation_tokens=self.generation_tokens,
                steps=self.steps,
                step_time_total=self.step_time_total,
                ttft=ttft,
                requests=self.requests.copy(),
                kv_cache_usage=kv_cache_usage,
                finished_by_reason=dict(self.finished_by_reason),
                spec=stats.spec,
                tier_entries=stats.tier_entries,
                tier_bytes=stats.tier_bytes,
                tier=stats.tier,
                tier_rejected_files=tier_rejected_files,
                host_tier_entries=stats.host_tier_entries,
                host_tier_bytes=stats.host_tier_bytes,
                host_tier=stats.host_tier,
            )
