"""Server wiring for `recap serve --role`: the engine for a role and its Prometheus series.

Series (each with a `model_name` and a `role` label), parallel to vLLM's kv-connector metrics:
  recap:disagg_transfers_sent_total / _received_total / _failed_total, recap:disagg_fallbacks_total,
  recap:disagg_holds_expired_total, recap:disagg_blocks_sent_total / _received_total,
  recap:disagg_blocks_local_total (full prompt blocks the decode side already held: never sent),
  recap:disagg_window_blocks_sent_total / _received_total (sliding-window layers' blocks),
  recap:disagg_checkpoints_sent_total / _received_total / _registered_total,
  recap:disagg_states_received_total, recap:disagg_bytes_sent_total / _received_total,
  recap:disagg_handles_refused_total (recap.disagg.trust),
  and the gauges recap:disagg_requests_held, recap:disagg_transfers_in_flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from recap.disagg.config import KVTransferConfig
from recap.disagg.engine import DisaggAsyncEngine, DisaggLLMEngine, TransferStats
from recap.disagg.transport import Transport
from recap.engine.async_engine import AsyncEngine
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine

_GAUGES = ("requests_held", "transfers_in_flight")
_HELP = {
    "transfers_sent": "Pulls answered with KV data (prefill side).",
    "transfers_received": "Pulls written into the caches and registered (decode side).",
    "transfers_failed": "Pulls that failed; each failed (or re-prefilled) one request (decode side).",
    "fallbacks": "Failed pulls re-run as local prefill (decode side).",
    "holds_expired": "Held requests released because nobody pulled them in time (prefill side).",
    "blocks_sent": "KV blocks sent (prefill side).",
    "blocks_received": "KV blocks received (decode side).",
    "blocks_local": "Full prompt KV blocks the decode side already held, so never sent.",
    "window_blocks_sent": "Sliding-window attention blocks sent (prefill side).",
    "window_blocks_received": "Sliding-window attention blocks received (decode side).",
    "checkpoints_sent": "Recurrent-state checkpoints sent (prefill side).",
    "checkpoints_received": "Recurrent-state checkpoints received (decode side).",
    "checkpoints_registered": "Received checkpoints registered in the decode side's prefix cache.",
    "states_received": "Prompt-end running states received (decode side).",
    "bytes_sent": "Tensor bytes sent (prefill side).",
    "bytes_received": "Tensor bytes received (decode side).",
    "requests_held": "Prefilled requests whose KV waits for a pull now.",
    "transfers_in_flight": "Pulls in flight now.",
}


class TransferCollector(Collector):
    def __init__(self, engine: DisaggLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats: TransferStats = self.engine.stats
        labels, values = ["model_name", "role"], [self.engine.served_model_name, self.engine.kv_role]
        for f in dataclasses.fields(TransferStats):
            name = f"recap:disagg_{f.name}"
            family = GaugeMetricFamily if f.name in _GAUGES else CounterMetricFamily
            metric = family(name, _HELP[f.name], labels=labels)
            metric.add_metric(values, float(getattr(stats, f.name)))
            yield metric
        refused = CounterMetricFamily("recap:disagg_handles_refused", "Transfer handles refused (decode side): not "
                                      "from a prefill peer, bad tag, expired or replayed.", labels=labels)
        refused.add_metric(values, float(self.engine.verifier.num_refused))
        yield refused


def build_engine(
    config: EngineConfig, transfer: KVTransferConfig, transport: Transport | None = None
) -> tuple[AsyncEngine, list[Collector]]:
    """The async engine for `transfer.role` and the extra collectors its /metrics serves; `transport`
    defaults to pyzmq on `transfer.kv_host`/`kv_port` (recap.disagg.zmq_transport)."""
    if transfer.role == "both":
        return AsyncEngine(LLMEngine(config)), []
    llm = DisaggLLMEngine(config, transfer, transport)
    return DisaggAsyncEngine(llm), [TransferCollector(llm)]
