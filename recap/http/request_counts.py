"""What became of every generation request (POST /v1/completions, /v1/chat/completions, /v1/responses), counted
at the HTTP level by recap.http.guard, so that /metrics alone shows that nothing went missing:

    recap:api_requests_received_total == success + aborted + rejected (+ in progress)

  recap:api_requests_received_total            requests whose headers arrived
  recap:api_requests_total{outcome=...}        success: a 2xx response sent to its end;
                                               aborted: the client left first (or the stream broke off);
                                               rejected: a 4xx/5xx answer (before or instead of generation)
  recap:api_requests_rejected_total{reason=...}  the rejected ones by reason (invalid_request, unauthorized,
                                               busy, body_too_large, body_timeout, not_found, internal_error, ...)
  recap:api_requests_in_progress               gauge
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

OUTCOMES = ("success", "aborted", "rejected")
CLIENT_GONE = 499  # what a handler answers when its client left first
_REASONS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
            408: "body_timeout", 413: "body_too_large", 422: "invalid_request", 429: "busy", 500: "internal_error",
            502: "upstream_error", 503: "unavailable", 504: "upstream_timeout"}


def rejection_reason(status: int) -> str:
    return _REASONS.get(status, f"http_{status}")


@dataclass
class RequestCounts:
    """Thread-safe tallies; `finish` is called once per received request."""

    received: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def receive(self) -> None:
        with self._lock:
            self.received += 1

    def finish(self, status: int | None, completed: bool) -> None:
        """`status`: the response status sent (None: none); `completed`: its body was sent to the end."""
        with self._lock:
            if status is None or status == CLIENT_GONE or (status < 400 and not completed):
                self.outcomes["aborted"] += 1
            elif status < 400:
                self.outcomes["success"] += 1
            else:
                self.outcomes["rejected"] += 1
                self.rejected[rejection_reason(status)] += 1

    def in_progress(self) -> int:
        with self._lock:
            return self.received - sum(self.outcomes.values())


class RequestCountsCollector(Collector):
    def __init__(self, counts: RequestCounts, model_name: str) -> None:
        self.counts = counts
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        c, labels, values = self.counts, ["model_name"], [self.model_name]
        with c._lock:
            received, outcomes, rejected = c.received, dict(c.outcomes), dict(c.rejected)
        m = CounterMetricFamily("recap:api_requests_received", "Generation requests received.", labels=labels)
        m.add_metric(values, float(received))
        yield m
        m = CounterMetricFamily("recap:api_requests", "Generation requests by outcome (success, aborted, rejected).",
                                labels=[*labels, "outcome"])
        for outcome in OUTCOMES:
            m.add_metric([*values, outcome], float(outcomes.get(outcome, 0)))
        yield m
        m = CounterMetricFamily("recap:api_requests_rejected", "Rejected generation requests by reason.",
                                labels=[*labels, "reason"])
        for reason in sorted({"invalid_request", "busy", *rejected}):
            m.add_metric([*values, reason], float(rejected.get(reason, 0)))
        yield m
        g = GaugeMetricFamily("recap:api_requests_in_progress", "Generation requests in progress now.", labels=labels)
        g.add_metric(values, float(received - sum(outcomes.values())))
        yield g
