"""The same engine metrics under vLLM's names (`vllm:` prefix, labels model_name and engine), so a vLLM
Grafana dashboard reads recap. Only what recap measures is exported; recap's own series (checkpoints,
state pool) stay under `recap:` (metrics.py). Finish-reason and rejection counters belong with the
request-limit code and are not duplicated here.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from recap.engine.async_engine import AsyncEngine
from recap.engine.histogram import Histogram
from recap.engine.metrics import MetricsSnapshot
from recap.engine.request_metrics import RequestHistograms

# (vLLM name without _total, help, MetricsSnapshot field: a dotted path)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec.num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec.num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec.num_accepted_tokens"),
    # vLLM's KV offloading connector's transfer counters; recap's lower tiers (host, disk) hold KV blocks and state
    # checkpoints, both counted. Per-tier series: recap:{host,disk}_tier_{load,store}_bytes (metrics.py).
    ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage into the read pools.",
     "offload_load_bytes"),
    ("vllm:kv_offload_store_bytes", "Total bytes stored from the read pools to offload storage.",
     "offload_store_bytes"),
)
_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)
# (vLLM name, help, RequestHistograms field)
_REQUEST_HISTOGRAMS = (
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue"),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", "inference"),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "prefill"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "decode"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token"),
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", "time_per_output_token"),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     "time_per_output_token"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "params_n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "params_max_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "step_tokens"),
)
VLLM_METRIC_NAMES = (
    tuple(n for n, _, _ in _COUNTERS) + tuple(n for n, _, _ in _GAUGES) + tuple(n for n, _, _ in _REQUEST_HISTOGRAMS)
    + ("vllm:request_success", "vllm:time_to_first_token_seconds", "vllm:cache_config_info",
       "vllm:spec_decode_num_accepted_tokens_per_pos")
)


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, count in zip(h.bounds, h.counts):
        total += count
        out.append((repr(float(bound)), float(total)))
    out.append(("+Inf", float(h.n)))
    return out


FINISH_REASONS = {"stop", "length", "abort", "error"}  # always exported, so a dashboard sees zeros


class VllmCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str, cache_labels: dict[str, str]) -> None:
        self.engine = engine
        self.labels = ["model_name", "engine"]
        self.values = [model_name, "0"]
        self.cache_labels = cache_labels

    def _histogram(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=self.labels)
        fam.add_metric(self.values, _buckets(h), sum_value=h.total)
        return fam

    def collect(self) -> Iterator[Metric]:
        s: MetricsSnapshot = self.engine.metrics()
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=self.labels)
            c.add_metric(self.values, float(attrgetter(attr)(s)))
            yield c
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=self.labels)
            g.add_metric(self.values, float(getattr(s, attr)))
            yield g
        done = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                   labels=[*self.labels, "finished_reason"])
        for reason in ("stop", "length", "abort", "error", *sorted(set(s.finished_by_reason) - FINISH_REASONS)):
            done.add_metric([*self.values, reason], float(s.finished_by_reason.get(reason, 0)))
        yield done
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*self.labels, "position"])
        for pos, count in enumerate(s.spec.accepted_per_position):
            per_pos.add_metric([*self.values, str(pos)], float(count))
        yield per_pos
        yield self._histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              s.ttft)
        req: RequestHistograms | None = s.requests
        if req is not None:
            for name, doc, attr in _REQUEST_HISTOGRAMS:
                yield self._histogram(name, doc, getattr(req, attr))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["engine", *self.cache_labels])
        info.add_metric(["0", *self.cache_labels.values()], 1.0)
        yield info
