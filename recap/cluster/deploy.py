"""Build the Serve applications (replicas + ingress), and start or join a Ray cluster.

Layout: one app (default name `recap`) holding the `RecapReplica` deployment (N replicas, one engine
each, CPU actors) routed by `RecapRequestRouter`, and the `RecapIngress` deployment at route prefix `/`.
`build_pd_app` builds the disaggregated layout instead: `RecapPrefill` and `RecapDecode` replicas behind
`RecapPDIngress` (recap.cluster.pd_ingress). `ingress_app` builds a second entry point over an existing
app's replicas with another routing policy (how the round-robin baseline is measured on the same replicas).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from recap.cluster.api import ReplicaAPI
from recap.cluster.ingress import REPLICA_DEPLOYMENT, IngressConfig, RecapIngress
from recap.cluster.pd_ingress import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, PDIngressConfig, RecapPDIngress
from recap.cluster.ray_transport import deployment_peer
from recap.cluster.replica import RecapReplica
from recap.cluster.router import POLICIES
from recap.cluster.stats import StatsLimits
from recap.disagg.config import KVTransferConfig
from recap.engine.config import EngineConfig

ROUTER_CLASS = "recap.cluster.ray_router.RecapRequestRouter"
POW2 = "pow2"  # Ray Serve's own default router (power of two choices on queue length): the baseline
ROUTINGS = (*POLICIES, POW2)


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 2
    cpus_per_replica: float = 1.0  # Ray's CPU reservation per replica; also its torch threads unless set
    policy: str = "checkpoint"  # checkpoint | round_robin | load (recap.cluster.router) | pow2 (Serve's own)
    queued_request_tokens: int = 256  # the router's cost of one queued request, in prefill tokens
    max_stats_age_s: float = 30.0
    stats_period_s: float = 0.5  # how often each replica publishes its routing stats
    limits: StatsLimits = field(default_factory=StatsLimits)
    max_ongoing_requests: int | None = None  # per replica; default: twice the engine's max_num_seqs
    # The ingress only relays (async): Serve's default of 5 made a sixth concurrent stream wait at the proxy.
    ingress_max_ongoing_requests: int = 1024
    app_name: str = "recap"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be positive, got {self.cpus_per_replica}")
        if self.policy not in ROUTINGS:
            raise ValueError(f"routing policy must be one of {ROUTINGS}, got {self.policy!r}")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be positive, got {self.stats_period_s}")


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Pin the model folder before it travels to the replicas (None: the trained default, a package folder)."""
    if config.model is not None:
        return config
    from recap.model.trained_default import default_model_path

    return dataclasses.replace(config, model=str(default_model_path()))


def replica_deployment(
    config: EngineConfig, cluster: ClusterConfig, http: ReplicaAPI, *,
    name: str = REPLICA_DEPLOYMENT, num_replicas: int | None = None, transfer: KVTransferConfig | None = None,
) -> Application:
    config = resolve_model(config)
    if config.num_threads is None:
        config = dataclasses.replace(config, num_threads=max(1, int(cluster.cpus_per_replica)))
    router_config = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"block_size": config.cache.block_size,
                               "queued_request_tokens": cluster.queued_request_tokens,
                               "max_stats_age_s": cluster.max_stats_age_s},
        request_routing_stats_period_s=cluster.stats_period_s,
    )
    routing = {} if cluster.policy == POW2 else {"request_router_config": router_config}
    deployment = serve.deployment(
        RecapReplica, name=name, num_replicas=num_replicas or cluster.num_replicas,
        ray_actor_options={"num_cpus": cluster.cpus_per_replica},
        max_ongoing_requests=cluster.max_ongoing_requests or 2 * config.scheduler.max_num_seqs,
        health_check_period_s=2.0, **routing,
    )
    return deployment.bind(config, cluster.limits, http, transfer)


def build_cluster_app(config: EngineConfig, cluster: ClusterConfig, http: ReplicaAPI) -> Application:
    """The replicas (serving `http`'s app) and their ingress, as one Serve application."""
    config = resolve_model(config)
    policy = "load" if cluster.policy == POW2 else cluster.policy  # (Serve's router ignores it)
    ingress = IngressConfig(tokenizer=config.tokenizer or str(config.model), chat_template=config.chat_template,
                            policy=policy, replica_app=cluster.app_name, enable_debug=http.limits.enable_debug)
    ingress_deployment = serve.deployment(RecapIngress, name="RecapIngress", ray_actor_options={"num_cpus": 0},
                                          max_ongoing_requests=cluster.ingress_max_ongoing_requests)
    return ingress_deployment.bind(replica_deployment(config, cluster, http), ingress, http)


def build_pd_app(config: EngineConfig, cluster: ClusterConfig, prefill_replicas: int, decode_replicas: int,
                 http: ReplicaAPI, transfer: KVTransferConfig | None = None) -> Application:
    """Prefill and decode replicas (their KV moved by recap.cluster.ray_transport) behind the P/D ingress.
    `transfer` gives the timeouts (its role, secret and peers are set here): the handles are signed with a
    fresh random secret that both deployments receive in their arguments (held by the Serve controller)."""
    if prefill_replicas < 1 or decode_replicas < 1:
        raise ValueError(f"prefill and decode replicas must be >= 1, got {prefill_replicas} and {decode_replicas}")
    config = resolve_model(config)
    if config.num_threads is None:
        config = dataclasses.replace(config, num_threads=max(1, int(cluster.cpus_per_replica)))
    secret = secrets.token_hex(32).encode()
    base = transfer or KVTransferConfig()
    prefill = dataclasses.replace(base, role="prefill", secret=secret, peers=())
    decode = dataclasses.replace(base, role="decode", secret=secret,
                                 peers=(deployment_peer(cluster.app_name, PREFILL_DEPLOYMENT),))
    ingress = PDIngressConfig(tokenizer=config.tokenizer or str(config.model), chat_template=config.chat_template,
                              app=cluster.app_name, enable_debug=http.limits.enable_debug,
                              kv_api_key=prefill.kv_api_key)
    deployment = serve.deployment(RecapPDIngress, name="RecapPDIngress", ray_actor_options={"num_cpus": 0},
                                  max_ongoing_requests=cluster.ingress_max_ongoing_requests)
    return deployment.bind(
        replica_deployment(config, cluster, http, name=PREFILL_DEPLOYMENT, num_replicas=prefill_replicas,
                           transfer=prefill),
        replica_deployment(config, cluster, http, name=DECODE_DEPLOYMENT, num_replicas=decode_replicas,
                           transfer=decode),
        ingress, http)


def ingress_app(tokenizer: str, policy: str, replica_app: str, api: ReplicaAPI, max_ongoing_requests: int = 1024
                ) -> Application:
    """A further entry point over the replicas of app `replica_app` (serving `api`), routing by `policy`."""
    deployment = serve.deployment(RecapIngress, name=f"RecapIngress-{policy}", ray_actor_options={"num_cpus": 0},
                                  max_ongoing_requests=max_ongoing_requests)
    return deployment.bind(None, IngressConfig(tokenizer=tokenizer, policy=policy, replica_app=replica_app), api)


@dataclass(frozen=True)
class LocalClusterConfig:
    """A small single-node Ray cluster on loopback (what `recap serve --replicas` starts without an address)."""

    num_cpus: int = 2
    object_store_bytes: int = 256 << 20
    host: str = "127.0.0.1"


def init_ray(address: str | None, local: LocalClusterConfig) -> None:
    """Join the cluster at `address`, or start a local one (no dashboard, loopback)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    ray.init(num_cpus=local.num_cpus, object_store_memory=local.object_store_bytes, include_dashboard=False,
             _node_ip_address=local.host)
