"""recap's router behind Ray Serve's public request-router interface.

Serve calls `choose_replicas` with the live candidates; each candidate carries the stats its replica
returned from `record_routing_stats` (recap.cluster.stats, pushed through the Serve controller every
`request_routing_stats_period_s`). The request's prompt tokens and cache salt travel in the call's
`route` keyword (the ingress tokenizes). Ranks are singletons, best first: Serve takes the first whose
queue is not full (`max_ongoing_requests`), else the next.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from recap.cluster import board
from recap.cluster.router import CheckpointRouter, RouterConfig, RouteRequest

ROUTE_KWARG = "route"
log = logging.getLogger("recap.cluster")


def route_request(pending: PendingRequest | None) -> RouteRequest:
    """The routing input the ingress attached to a call (none: route by load alone)."""
    route = pending.kwargs.get(ROUTE_KWARG) if pending is not None else None
    if not isinstance(route, Mapping):
        return RouteRequest((), policy="load")
    return RouteRequest(tuple(route.get("tokens", ())), route.get("cache_salt"), route.get("policy", "checkpoint"),
                        route.get("pin"))


class RecapRequestRouter(RequestRouter):
    """Checkpoint-aware routing (recap.cluster.router) for a deployment of recap replicas."""

    # Serve probes the first rank's queue length before sending; a probe that misses its deadline passes
    # the request to the next rank. Serve's 0.1 s default was missed under CPU contention (a replica's
    # engine step holds the GIL), which moved sessions away from their checkpoints: wait longer instead.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(self, **kwargs: Any) -> None:
        self.core = CheckpointRouter(RouterConfig(**kwargs))
        board.register(self.app_name, self._deployment_id.name, self)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, replica in by_id.items():
            self.core.update_stats(rid, replica.routing_stats)
        route = route_request(pending_request)
        ranked = self.core.rank(list(by_id), route)
        log.debug("route %d tokens (salt %s, policy %s, pin %s) -> %s", len(route.token_ids), route.cache_salt,
                  route.policy, route.pin, ranked)
        return [[by_id[rid]] for rid in ranked]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give the replica to the very request it was chosen for (its prompt's checkpoint, or its pin).

        Serve's default matches the request by internal request id, which the calls one ingress request fans out
        share (the integrity check pinned to each replica), and FIFOMixin gives it to the oldest pending request:
        either sent a choice made for one prompt or pin to another request (an integrity call answered twice by
        one replica and never by the other). A request no longer pending (cancelled) takes nothing.
        """
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                return

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = pending_request.metadata.internal_request_id
        self.core.on_routed(replica_id.unique_id, key, route_request(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.core.on_completed(replica_id.unique_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.core.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.core.forget(replica_id.unique_id)
