"""Prometheus exposition: a Collector that reads AsyncEngine.metrics() at scrape time.

Names run parallel to vLLM's (`vllm:prefix_cache_queries_total` -> `recap:prefix_cache_queries_total`);
every series carries a `model_name` label. vLLM's own names are exported too (vllm_metrics.py).
A private registry per app, so several servers can
live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from recap.engine.async_engine import AsyncEngine
from recap.engine.histogram import Histogram
from recap.engine.metrics import MetricsSnapshot

# (name without _total, help, snapshot field)
_COUNTERS = (
    ("recap:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("recap:prefix_cache_hits", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
    ("recap:checkpoints_created", "Recurrent-state checkpoints registered.", "checkpoints_created"),
    ("recap:checkpoint_evictions", "Recurrent-state checkpoints evicted.", "checkpoint_evictions"),
    ("recap:checkpoint_miss_tokens", "Prompt tokens whose KV was cached past the best checkpoint (recomputed).",
     "checkpoint_miss_tokens"),
    ("recap:num_preemptions", "Requests preempted.", "preemptions"),
    ("recap:failed_steps", "Engine steps that raised; their requests were retried apart.", "failed_steps"),
    ("recap:step_suspects", "Requests of failed steps preempted to be retried one per step.", "step_suspects"),
    ("recap:prompt_tokens", "Prompt tokens of finished requests.", "prompt_tokens"),
    ("recap:generation_tokens", "Tokens generated.", "generation_tokens"),
    ("recap:engine_steps", "Engine steps run.", "steps"),
    ("recap:disk_tier_demotions", "Checkpoints and KV blocks saved to the disk tier.", "tier.demotions"),
    ("recap:disk_tier_hits", "Disk tier entries a hit read.", "tier.hits"),
    ("recap:disk_tier_promotions", "Disk tier entries loaded back into the read pools.", "tier.promotions"),
    ("recap:disk_tier_failed_loads", "Disk tier loads that failed (missing, corrupt or foreign file).",
     "tier.promotions_failed"),
    ("recap:disk_tier_evictions", "Disk tier entries deleted to stay within its byte budget.", "tier.evictions"),
    ("recap:disk_tier_rejected_files", "Corrupt, truncated or foreign disk tier files deleted, never loaded.",
     "tier_rejected_files"),
    ("recap:host_tier_demotions", "Checkpoints and KV blocks saved to the host-memory tier.", "host_tier.demotions"),
    ("recap:host_tier_hits", "Host-memory tier entries a hit read.", "host_tier.hits"),
    ("recap:host_tier_promotions", "Host-memory tier entries copied back into the read pools.",
     "host_tier.promotions"),
    ("recap:host_tier_evictions", "Host-memory tier entries moved to the disk tier or dropped for room.",
     "host_tier.evictions"),
    ("recap:disk_tier_load_bytes", "Bytes promoted from the disk tier into the read pools.", "tier.loaded_bytes"),
    ("recap:disk_tier_store_bytes", "Bytes saved from the read pools into the disk tier.", "tier.stored_bytes"),
    ("recap:host_tier_load_bytes", "Bytes promoted from the host-memory tier into the read pools.",
     "host_tier.loaded_bytes"),
    ("recap:host_tier_store_bytes", "Bytes saved from the read pools into the host-memory tier.",
     "host_tier.stored_bytes"),
)
_GAUGES = (
    ("recap:checkpoints", "Recurrent-state checkpoints held now.", "checkpoints"),
    ("recap:checkpoint_bytes", "Bytes held by recurrent-state checkpoints now.", "checkpoint_bytes"),
    ("recap:num_requests_running", "Requests running now.", "num_running"),
    ("recap:num_requests_waiting", "Requests waiting now.", "num_waiting"),
    ("recap:disk_tier_entries", "Checkpoints and KV blocks held by the disk tier now.", "tier_entries"),
    ("recap:disk_tier_bytes", "Payload bytes held by the disk tier now.", "tier_bytes"),
    ("recap:host_tier_entries", "Checkpoints and KV blocks held by the host-memory tier now.", "host_tier_entries"),
    ("recap:host_tier_bytes", "Payload bytes held by the host-memory tier now.", "host_tier_bytes"),
)


def _cumulative(h: Histogram) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, count in zip(h.bounds, h.counts):
        total += count
        out.append((repr(float(bound)), float(total)))
    out.append(("+Inf", float(h.n)))
    return out


class EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str, config_labels: dict[str, str]) -> None:
        self.engine = engine
        self.model_name = model_name
        self.config_labels = config_labels

    def collect(self) -> Iterator[Metric]:
        s: MetricsSnapshot = self.engine.metrics()
        labels, values = ["model_name"], [self.model_name]
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(attrgetter(attr)(s)))
            yield c
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(getattr(s, attr)))
            yield g
        done = CounterMetricFamily("recap:request_success", "Requests finished (one per prompt), by finished_reason "
                                   "(stop, length, abort, error), as vLLM's request_success.",
                                   labels=[*labels, "finished_reason"])
        for reason, count in sorted(s.finished_by_reason.items()):
            done.add_metric([*values, reason], float(count))
        yield done
        h = HistogramMetricFamily("recap:time_to_first_token_seconds", "Time to first token.", labels=labels)
        h.add_metric(values, _cumulative(s.ttft), sum_value=s.ttft.total)
        yield h
        info = GaugeMetricFamily("recap:cache_config_info", "Cache configuration (value is 1).",
                                 labels=[*labels, *self.config_labels])
        info.add_metric([*values, *self.config_labels.values()], 1.0)
        yield info


def make_registry(engine: AsyncEngine, model_name: str, config_labels: dict[str, str]) -> CollectorRegistry:
    from recap.server.vllm_metrics import VllmCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name, config_labels))
    registry.register(VllmCollector(engine, model_name, config_labels))  # the same numbers under vLLM's names
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
