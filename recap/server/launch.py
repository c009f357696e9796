"""`recap serve`: build the engine from flags, then run the app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from recap.cluster.launch import add_cluster_args, cluster_mode, serve_replicas
from recap.disagg.config import add_disagg_args, transfer_config
from recap.server.args import add_engine_args, engine_config
from recap.server.limits import add_limit_args, server_limits
from recap.server.options import add_http_args, server_options

log = logging.getLogger("recap.server")
LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model folder or hub id (default: the embedded default model)")
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

    import uvicorn

    from recap.disagg.serving import build_engine
    from recap.process.heap import retain_freed_memory
    from recap.server.app import build_app
    from recap.server.timeouts import header_timeout_protocol

    retain_freed_memory()  # prefill temporaries reuse heap memory instead of page-faulting (process/heap.py)
    log.info("loading %s", config.model or "the embedded default model")
    try:
        engine, collectors = build_engine(config, transfer)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: cannot load the model: {e}", file=sys.stderr)
        return 1
    llm = engine.engine
    app = build_app(engine, collectors=collectors, options=server_options(args), limits=limits, api_key=args.api_key)
    log.info("serving %s on http://%s:%d (OpenAI API under /v1, role %s)", llm.served_model_name, args.host,
             args.port, transfer.role)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                access_log=False, http=header_timeout_protocol(limits.header_timeout_s),
                timeout_keep_alive=limits.idle_timeout_s)
    return 0
