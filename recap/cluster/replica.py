"""One recap replica on Ray Serve: an engine, the single-instance app over it (built by its ReplicaAPI,
recap.cluster.api: the OpenAI app), and its routing stats."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from recap.cluster.api import ReplicaAPI
from recap.cluster.asgi import REPLICA_HEADER, HTTPRequest, ResponseStart, call_asgi
from recap.cluster.ray_transport import RayTransport
from recap.cluster.stats import StatsLimits, collect_stats
from recap.disagg.config import KVTransferConfig
from recap.disagg.serving import build_engine
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine

log = logging.getLogger("recap.cluster")


class RecapReplica:
    """Serve deployment body. `http` streams one forwarded request's response: a ResponseStart (with the
    replica's id in the `x-recap-replica` header), then body chunks; the ids of the responses its app stores
    carry that id too (recap.http.response_ids). With a `transfer` config the replica is a prefill or decode
    instance of a disaggregated deployment (recap.cluster.pd_ingress), its KV moved between replicas by
    recap.cluster.ray_transport; a prefill replica answers `kv_pull`, `kv_release` and `kv_accept`."""

    def __init__(self, config: EngineConfig, limits: StatsLimits, http: ReplicaAPI,
                 transfer: KVTransferConfig | None = None) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.limits = limits
        self.transport = RayTransport(context.app_name, context.deployment, self.replica_id)
        transfer = transfer or KVTransferConfig()
        engine, collectors = build_engine(config, transfer, self.transport)
        self.engine = engine
        self.engine.start()
        # Its lifespan never runs here (we own the engine); auth, limits and CORS are the single instance's.
        self.app = http.build(self.engine, collectors, transfer, self.replica_id)
        log.info("replica %s serving %s", self.replica_id, self.engine.engine.served_model_name)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every request_routing_stats_period_s; read on the engine thread between steps."""

        def take(engine: LLMEngine) -> dict[str, Any]:
            sched = engine.scheduler
            return collect_stats(sched.cache, sched.num_running, sched.num_waiting, time.time(), self.limits).to_dict()

        return await self.engine.call(take)

    async def http(self, request: HTTPRequest, route: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """`route` is read by the router (recap.cluster.ray_router), not here."""
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, item.headers + ((REPLICA_HEADER, self.replica_id.encode()),))
            yield item

    async def kv_pull(self, header: dict[str, Any], route: dict[str, Any] | None = None) -> dict[str, Any]:
        """Prefill: a decode replica's pull (recap.cluster.ray_transport); the gather runs off the event loop."""
        return await asyncio.to_thread(self.transport.answer, header)

    async def kv_release(self, transfer_id: str, mac: str, route: dict[str, Any] | None = None) -> bool:
        """Prefill: the held request may go (its data arrived, or nobody will pull it)."""
        return self.transport.acknowledge(transfer_id, mac)

    async def kv_accept(self, transfer_id: str, mac: str, route: dict[str, Any] | None = None) -> bool:
        """Prefill: a decode replica took the handle; hold for its pull up to the hold timeout."""
        return self.transport.keep(transfer_id, mac)

    async def check_health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine stopped: {self.engine.dead!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
