"""`recap serve`: build the engine from flags, then run the OpenAI app under uvicorn (or replicas on Ray)."""

from __future__ import annotations

import argparse
import logging
import sys

from recap.disagg.config import add_disagg_args, transfer_config
from recap.engine.errors import MemoryPlanError
from recap.http.limits import add_limit_args, server_limits
from recap.launch.engine_args import add_engine_args, engine_config
from recap.launch.replicas import add_cluster_args, cluster_mode, serve_replicas
from recap.server.options import add_http_args, server_options

log = logging.getLogger("recap.server")
LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model folder or hub id (default: the trained default model)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                   help="uvicorn's own log level (default: --log-level)")
    add_engine_args(p)
    add_http_args(p)
    add_disagg_args(p)
    add_limit_args(p)
    add_cluster_args(p)


def serve(args: argparse.Namespace) -> int:
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            print(f"error: MODEL {args.model!r} and --model {args.model_flag!r} disagree", file=sys.stderr)
            return 2
        args.model = args.model_flag
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        mode = cluster_mode(args)
        config = engine_config(args)
        transfer = transfer_config(args)
        limits = server_limits(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if mode is not None:
        return serve_replicas(args, config, transfer)

    from recap.disagg.serving import build_engine
    from recap.http.timeouts import run_server
    from recap.launch.settings import ServerSettings
    from recap.process.heap import retain_freed_memory

    retain_freed_memory()  # prefill temporaries reuse heap memory instead of page-faulting (process/heap.py)
    log.info("loading %s", config.model or "the trained default model")
    try:
        engine, collectors = build_engine(config, transfer)
    except MemoryPlanError as e:  # refused before loading the weights or allocating the pools: a usage error
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: cannot load the model: {e}", file=sys.stderr)
        return 1
    llm = engine.engine
    log.info("memory plan: %s", llm.runner.memory_plan().describe())
    if llm.default_sampling:
        log.info("defaults for fields a request leaves unset (generation_config.json): %s", llm.default_sampling)
    app = ServerSettings(limits, args.api_key, server_options(args)).build(engine, collectors, transfer,
                                                                          shutdown_engine=True)
    log.info("serving %s on http://%s:%d (OpenAI API under /v1, role %s)", llm.served_model_name, args.host,
             args.port, transfer.role)
    run_server(app, args.host, args.port, args.uvicorn_log_level or args.log_level, limits)
    return 0
