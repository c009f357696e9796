"""`recap serve --replicas N`: recap replicas on Ray Serve behind the checkpoint-aware router; `--prefill-replicas P
--decode-replicas D`: a disaggregated deployment (recap.cluster.pd_ingress).

Joins the cluster at `--ray-address`, or starts a small local one on loopback; Serve's HTTP proxy
listens on --host/--port (a Serve instance already running on a joined cluster keeps its own).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from recap.disagg.config import KVTransferConfig
from recap.engine.config import EngineConfig

log = logging.getLogger("recap.cluster")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (docs/replicas.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind recap's router (default: one process, no Ray)")
    g.add_argument("--prefill-replicas", type=int, default=None, metavar="P",
                   help="disaggregated: P prefill replicas (with --decode-replicas), the KV moved through Ray")
    g.add_argument("--decode-replicas", type=int, default=None, metavar="D",
                   help="disaggregated: D decode replicas (with --prefill-replicas)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://host:10001 or auto); default: start a local one")
    g.add_argument("--routing", choices=("checkpoint", "round_robin", "load", "pow2"), default="checkpoint",
                   help="how requests pick a replica (checkpoint: deepest resumable prefix against queue length; "
                        "pow2: Ray Serve's default router)")
    g.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs reserved per replica (also its torch threads unless --num-threads)")
    g.add_argument("--queued-request-tokens", type=int, default=256,
                   help="routing cost of one queued request, in prefill tokens")


def cluster_mode(args: argparse.Namespace) -> str | None:
    """"replicas", "disaggregated", or None (one process); ValueError on a contradictory combination."""
    pd = (args.prefill_replicas, args.decode_replicas)
    if pd == (None, None):
        mode = None if args.replicas is None else "replicas"
    elif None in pd:
        raise ValueError("--prefill-replicas and --decode-replicas go together")
    elif args.replicas is not None:
        raise ValueError("--replicas serves whole replicas; give it or --prefill-replicas/--decode-replicas, not both")
    else:
        mode = "disaggregated"
    if mode is not None and args.role != "both":
        raise ValueError("--role prefill/decode is not supported with Ray replicas (they set each replica's role)")
    return mode


def serve_replicas(args: argparse.Namespace, config: EngineConfig, transfer: KVTransferConfig) -> int:
    try:
        from ray import serve
    except ImportError:  # the [ray] extra: `make serve` installs the one-process server only
        print("error: replicas run on Ray Serve, which is not installed: .venv/bin/pip install -e '.[ray]'",
              file=sys.stderr)
        return 2

    from recap.cluster.deploy import ClusterConfig, LocalClusterConfig, build_cluster_app, build_pd_app, init_ray
    from recap.http.limits import server_limits
    from recap.launch.settings import ServerSettings
    from recap.server.options import server_options

    try:
        disaggregated = cluster_mode(args) == "disaggregated"
        total = args.prefill_replicas + args.decode_replicas if disaggregated else args.replicas
        cluster = ClusterConfig(num_replicas=total, cpus_per_replica=args.cpus_per_replica,
                                policy=args.routing, queued_request_tokens=args.queued_request_tokens)
        http = ServerSettings(server_limits(args), args.api_key, server_options(args))
        if disaggregated:
            app = build_pd_app(config, cluster, args.prefill_replicas, args.decode_replicas, http, transfer)
        else:
            app = build_cluster_app(config, cluster, http)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Local cluster: the replicas' CPUs, plus one for Serve's controller, proxy and the ingress.
    num_cpus = max(2, int(cluster.num_replicas * cluster.cpus_per_replica + 0.999) + 1)
    init_ray(args.ray_address, LocalClusterConfig(num_cpus=min(num_cpus, os.cpu_count() or num_cpus), host=args.host))
    serve.start(http_options={"host": args.host, "port": args.port})
    layout = (f"{args.prefill_replicas} prefill + {args.decode_replicas} decode replicas" if disaggregated
              else f"{cluster.num_replicas} replicas")
    log.info("serving %s on http://%s:%d (OpenAI API under /v1, routing %s)", layout, args.host, args.port,
             cluster.policy)
    serve.run(app, name=cluster.app_name, route_prefix="/", blocking=True)
    return 0
