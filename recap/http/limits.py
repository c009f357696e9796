"""What one request may ask of the server, and how long a client may take: `ServerLimits` and its flags.

Checked before a body reaches the engine (recap.http.guard, recap.http.json_body and `check_body`):
each excess is a 4xx naming the limit and the flag that sets it. Time limits: a connection must finish
its request headers within `header_timeout_s` (recap.http.timeouts), its body within `body_timeout_s`,
and an idle keep-alive connection is closed after `idle_timeout_s`. Admission: at most `max_queued`
generation sequences (n x prompts) in the server at once; past that a 429 with Retry-After
(recap.http.guard).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from recap.http.errors import APIError
from recap.http.json_body import DEFAULT_MAX_DEPTH, parse_json
from recap.units import positive_bytes

MAX_PROMPTS = 256  # prompts in one completions request (the OpenAI request models' cap: recap.server.protocol)
MAX_STOP = 16  # stop strings (likewise)
# The request models' own caps: a flag may lower them (its check then runs first), never raise them.
CAPS = {"max_prompts": MAX_PROMPTS, "max_stop": MAX_STOP}


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 * 2**20
    max_json_depth: int = DEFAULT_MAX_DEPTH
    max_prompts: int = MAX_PROMPTS  # prompts in one completions request
    max_stop: int = MAX_STOP  # stop strings
    max_logit_bias: int = 1024  # logit_bias entries
    max_queued: int = 1024  # generation sequences (n x prompts) in the server at once (running, waiting, prepared)
    retry_after_s: int = 1  # the Retry-After of a 429 / 503
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 5.0  # keep-alive: uvicorn's timeout_keep_alive
    enable_debug: bool = False  # /debug/* (integrity checks cost engine time)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompts", "max_stop", "max_logit_bias", "max_queued",
                     "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name, cap in CAPS.items():
            if getattr(self, name) > cap:
                raise ValueError(f"{name} must be at most {cap} (the request models' own limit), got "
                                 f"{getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _too_many(what: str, count: int, limit: int, param: str, flag: str) -> APIError:
    return APIError(f"{param}: {count} {what}, at most {limit} are allowed (server flag {flag})", param=param,
                    code="limit_exceeded")


def check_body(data: dict[str, Any], limits: ServerLimits) -> None:
    """Counts in a parsed body, before the pydantic model sees it (its own checks come after)."""
    prompt, stop = data.get("prompt"), data.get("stop")
    lowered = {name for name, cap in CAPS.items() if getattr(limits, name) < cap}  # else the models' checks speak
    if "max_prompts" in lowered and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            and len(prompt) > limits.max_prompts:
        raise _too_many("prompts", len(prompt), limits.max_prompts, "prompt", "--max-prompts")
    if "max_stop" in lowered and isinstance(stop, list) and len(stop) > limits.max_stop:
        raise _too_many("stop strings", len(stop), limits.max_stop, "stop", "--max-stop")
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise _too_many("logit_bias entries", len(bias), limits.max_logit_bias, "logit_bias", "--max-logit-bias")


def parse_body(body: bytes, limits: ServerLimits) -> dict[str, Any]:
    """A request body as a JSON object within the limits (recap.http.json_body, then `check_body`)."""
    data = parse_json(body, limits.max_json_depth)
    check_body(data, limits)
    return data


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Flags of `recap serve` and `recap proxy`: request limits, timeouts, admission, auth, /debug."""
    d = ServerLimits()
    p.add_argument("--api-key", default=None, help="clients must send `Authorization: Bearer KEY` on every /v1 route "
                   "(/health and /metrics stay open); the proxy also sends it upstream")
    p.add_argument("--max-body-bytes", type=positive_bytes, default=d.max_body_bytes, help="request body size limit")
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth, help="JSON nesting depth limit")
    p.add_argument("--max-prompts", type=int, default=d.max_prompts, help="prompts per completions request")
    p.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    p.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias entries per request")
    p.add_argument("--max-queued", type=int, default=d.max_queued,
                   help="generation sequences (n x prompts of each request) in the server at once; more get 429 "
                   "with Retry-After, and a request asking for more alone a 400")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s, help="seconds to send request headers")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s, help="seconds to send a request body")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, help="seconds a keep-alive connection idles")
    p.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve /debug/integrity (an integrity check on the engine thread per call; for tests, soaks)")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """Raises ValueError naming the field when a value is out of range."""
    return ServerLimits(
        max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth, max_prompts=args.max_prompts,
        max_stop=args.max_stop, max_logit_bias=args.max_logit_bias, max_queued=args.max_queued,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, idle_timeout_s=args.idle_timeout,
        enable_debug=args.enable_debug_endpoints,
    )
