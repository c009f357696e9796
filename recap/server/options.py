"""HTTP-level options of `recap serve` (vLLM's flag names): CORS and the request-id header.

CORS is off unless origins are given (`--allowed-origins '["*"]'` is vLLM's default; recap listens on
loopback by default and adds the header only when asked).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from recap.server.reasoning import PARSERS as REASONING_PARSERS
from recap.server.response_store import DEFAULT_CAPACITY as DEFAULT_STORE_SIZE
from recap.server.template_sandbox import FLAG as TRUST_TEMPLATE_FLAG
from recap.server.template_sandbox import TemplateLimits, TemplateSandbox
from recap.server.tools import PARSERS


@dataclass(frozen=True)
class ServerOptions:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    tool_call_parser: str | None = None  # None: detected from the chat template (recap/server/tools.py)
    # Seconds between giving free malloc memory back to the OS (recap.server.process_memory); 0: never (the
    # default: recap.process.heap keeps freed memory for the next prefill on purpose).
    malloc_trim_interval_s: float = 0.0
    # vLLM's --trust-request-chat-template: requests may carry their own chat template, rendered in a sandboxed
    # process under these limits (recap/server/template_sandbox.py); off: such a request is a 400.
    trust_request_chat_template: bool = False
    chat_template_limits: TemplateLimits = TemplateLimits()
    # POST /v1/responses with store: the responses kept for previous_response_id and GET (an LRU; 0: none).
    responses_store_size: int = DEFAULT_STORE_SIZE
    # vLLM's --reasoning-parser (recap/server/reasoning.py): chat and /v1/responses answers split into reasoning
    # and content; None: all content. An output constraint then starts once the think block ends, unless
    # grammar_in_reasoning (vLLM's --structured-outputs-config.enable_in_reasoning) constrains it as well.
    reasoning_parser: str | None = None
    grammar_in_reasoning: bool = False

    def template_sandbox(self) -> TemplateSandbox | None:
        """Where requests' own chat templates render; None when they are refused."""
        return TemplateSandbox(self.chat_template_limits) if self.trust_request_chat_template else None


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-origins", type=_json_list, default=[],
                   help='CORS origins as a JSON list, e.g. \'["*"]\' (default: no CORS headers)')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list)")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how tool calls are read from the model's text (default: detected from the chat template)")
    p.add_argument("--malloc-trim-interval", type=float, default=0.0, metavar="SECONDS",
                   help="give free malloc memory back to the OS this often when over 64 MiB is free and resident "
                        "memory grew as much since the last trim (glibc; lower RSS, but the next large prefill "
                        "page-faults its memory back; default 0: never)")
    p.add_argument(TRUST_TEMPLATE_FLAG, action="store_true",
                   help="let requests carry their own chat template (`chat_template`, or chat_template_kwargs."
                        "chat_template); it renders in a sandboxed process with time, memory and output limits")
    p.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE, metavar="N",
                   help="POST /v1/responses: keep the last N responses with store true (OpenAI's default) for "
                        f"previous_response_id and GET /v1/responses/{{id}}, least recently used forgotten first "
                        f"(default {DEFAULT_STORE_SIZE}; 0: keep none, responses say store false)")
    p.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                   help="split reasoning models' answers into `reasoning` (the <think> block) and `content`, as "
                        "vLLM's parser of that name: qwen3 (Qwen3, Qwen3-Next, Qwen3.5), deepseek_r1 (also "
                        "nemotron_v3 for Nemotron-3 Nano / Nemotron-H reasoning, minimax_m2); default: none")
    p.add_argument("--structured-outputs-config.enable_in_reasoning", dest="grammar_in_reasoning",
                   type=_true_or_false, default=False, metavar="true|false",
                   help="vLLM's: with --reasoning-parser, apply response_format and other output constraints "
                        "inside the think block too (default false: they start when it ends)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto; recap enables it whenever a parser is known")


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def server_options(args: argparse.Namespace) -> ServerOptions:
    if args.malloc_trim_interval < 0:
        raise SystemExit(f"--malloc-trim-interval must be >= 0, got {args.malloc_trim_interval}")
    if args.responses_store_size < 0:
        raise SystemExit(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    return ServerOptions(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                         args.allow_credentials, args.tool_call_parser, args.malloc_trim_interval,
                         trust_request_chat_template=args.trust_request_chat_template,
                         responses_store_size=args.responses_store_size, reasoning_parser=args.reasoning_parser,
                         grammar_in_reasoning=args.grammar_in_reasoning)


def install(app: FastAPI, options: ServerOptions) -> None:
    """CORS (when origins are set) and the X-Request-Id echo: a client's id comes back on its response."""
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                           allow_credentials=options.allow_credentials)

    app.add_middleware(RequestIdEcho)


class RequestIdEcho:
    """Plain ASGI (no BaseHTTPMiddleware: the handlers read http.disconnect from `receive` themselves)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
