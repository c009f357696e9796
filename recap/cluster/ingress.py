"""The OpenAI-compatible ingress in front of recap replicas on Ray Serve.

It does two things of its own and leaves the API to the replicas (which run recap.server.app as is):
tokenizes the prompt exactly as a replica would, so the router can hash its block chain; and relays
the request to the replica the router picks. A replica that dies fails the requests it was serving
with an OpenAI error body (503 before the response started, an error event in a stream after), and
Serve stops routing to it. `/debug/integrity` asks every replica for its cache core's check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from recap.cluster.asgi import REPLICA_HEADER, HTTPRequest, ResponseStart
from recap.cluster.board import replicas_of
from recap.cluster.ray_router import ROUTE_KWARG
from recap.cluster.router import POLICIES
from recap.model.loader import load_tokenizer
from recap.server.chat_prompt import build_chat_input
from recap.server.errors import APIError
from recap.server.json_body import parse_json
from recap.server.protocol import ChatCompletionRequest
from recap.server.sse import SSE_DONE, sse

log = logging.getLogger("recap.cluster")
REPLICA_DEPLOYMENT = "RecapReplica"
_DROP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


@dataclass(frozen=True)
class IngressConfig:
    tokenizer: str  # the replicas' tokenizer (folder or hub id): prompts are hashed as the replicas hash them
    policy: str = "checkpoint"  # checkpoint | round_robin | load
    replica_app: str = "recap"  # the Serve app whose RecapReplica deployment serves the requests
    enable_debug: bool = False  # /debug/integrity (as `recap serve --enable-debug-endpoints` on the replicas)
    debug_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")


def prompt_tokens(tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
    """The first prompt's token ids and the cache salt, as the replica will see them; ([], None) when the
    body is not a request this can read (the replica then answers with the proper 4xx)."""
    try:
        data = parse_json(body)  # depth, NaN and surrogates refused as the replica refuses them
    except APIError:
        return [], None
    if not isinstance(data, dict):
        return [], None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    if path == "/v1/chat/completions":
        try:
            return build_chat_input(tokenizer, ChatCompletionRequest.model_validate(data).messages).token_ids, salt
        except (ValidationError, APIError):
            return [], None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str) and prompt:
        return list(tokenizer.encode(prompt, add_special_tokens=False)), salt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), salt
    return [], None


def replica_gone(err: BaseException) -> APIError:
    return APIError(f"the replica serving this request stopped: {type(err).__name__}", status=503,
                    type="service_unavailable", code="replica_unavailable")


def call_replica(handle: DeploymentHandle, request: HTTPRequest, route: dict[str, Any]) -> Any:
    """A replica's streamed answer to `request`, routed by `route` (recap.cluster.ray_router)."""
    return handle.options(stream=True, method_name="http").remote(request, **{ROUTE_KWARG: route})


async def relay(stream: Any, path: str) -> Response:
    """The client's response from a replica's streamed answer; a replica that dies before its response
    started answers 503 with an OpenAI error body, one that dies mid-stream ends the stream with it."""
    try:
        start = await stream.__anext__()
    except RayActorError as e:
        log.warning("replica died before answering %s: %r", path, e)
        return replica_gone(e).response()
    if not isinstance(start, ResponseStart):
        raise RuntimeError(f"replica answered {type(start).__name__} before a response start")
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k not in _DROP_HEADERS}
    if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
        return StreamingResponse(_relay_events(stream), status_code=start.status, headers=headers)
    try:
        content = b"".join([chunk async for chunk in stream])
    except RayActorError as e:
        log.warning("replica died while answering %s: %r", path, e)
        return replica_gone(e).response()
    return Response(content, status_code=start.status, headers=headers)


async def collect(handle: DeploymentHandle, request: HTTPRequest, route: dict[str, Any], timeout_s: float
                  ) -> tuple[str, int, Any]:
    """(the answering replica's id, status, JSON answer) of a small request."""
    async def run() -> tuple[str, int, Any]:
        replica, status, chunks = "", 0, []
        async for c in call_replica(handle, request, route):
            if isinstance(c, ResponseStart):
                replica, status = (c.header(REPLICA_HEADER) or b"").decode(), c.status
            else:
                chunks.append(c)
        return replica, status, json.loads(b"".join(chunks))

    return await asyncio.wait_for(run(), timeout_s)


async def integrity_of(handle: DeploymentHandle, app: str, deployment: str, timeout_s: float) -> dict[str, Any]:
    """Each known replica's /debug/integrity by replica id (a call pinned to each). A replica that left
    between listing and asking is left out (its pinned call fell back to another replica, or failed)."""
    ids = replicas_of(app, deployment)
    if not ids:  # the handle's router is built on first use
        await collect(handle, HTTPRequest("GET", "/health"), {"policy": "load"}, timeout_s)
        ids = replicas_of(app, deployment)
    reports = await asyncio.gather(*(collect(handle, HTTPRequest("GET", "/debug/integrity"), {"pin": rid}, timeout_s)
                                     for rid in ids), return_exceptions=True)
    out: dict[str, Any] = {}
    for rid, report in zip(ids, reports):
        if isinstance(report, RayActorError):
            continue  # it died while answering
        if not isinstance(report, tuple):
            out[rid] = {"ok": False, "error": repr(report)}
        elif report[0] == rid:
            out[rid] = report[2]
    return out


def forwarded(request: Request, body: bytes) -> tuple[str, HTTPRequest]:
    """The path as the replicas serve it (at /, whatever the ingress's route prefix) and the request."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path, HTTPRequest(request.method, path, body, request.url.query.encode(),
                             tuple((k.lower(), v) for k, v in request.headers.raw))


async def read_request(request: Request, tokenizer: Any) -> tuple[str, HTTPRequest, list[int], str | None]:
    """The path, the request to forward, and (for a POST) the first prompt's tokens and cache salt, which
    are rendered and tokenized off the event loop: a long chat takes long enough to stall other requests."""
    body = await request.body()
    path, forward = forwarded(request, body)
    if request.method != "POST":
        return path, forward, [], None
    tokens, salt = await asyncio.to_thread(prompt_tokens, tokenizer, path, body)
    return path, forward, tokens, salt


def debug_off() -> Response:
    return APIError("Not Found", status=404, code="not_found").response()


class RecapIngress:
    """Serve deployment body (the app's HTTP entry point)."""

    def __init__(self, replicas: DeploymentHandle | None, config: IngressConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.replicas = replicas or serve.get_deployment_handle(REPLICA_DEPLOYMENT, config.replica_app)

    async def __call__(self, request: Request) -> Response:
        path, forward, tokens, salt = await read_request(request, self.tokenizer)
        if path == "/debug/integrity" and request.method == "GET":
            return JSONResponse(await self.integrity()) if self.config.enable_debug else debug_off()
        stream = call_replica(self.replicas, forward, {"tokens": tokens, "cache_salt": salt,
                                                      "policy": self.config.policy})
        return await relay(stream, path)

    async def integrity(self) -> dict[str, Any]:
        """Every known replica's /debug/integrity, by replica id; ok when all are."""
        out = await integrity_of(self.replicas, self.config.replica_app, REPLICA_DEPLOYMENT,
                                 self.config.debug_timeout_s)
        return {"ok": bool(out) and all(r.get("ok") for r in out.values()), "replicas": out}


async def _relay_events(stream: Any) -> Any:
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as e:  # the 200 is out: report in-stream, as the replicas do
        log.warning("replica died mid-stream: %r", e)
        yield sse(json.dumps(replica_gone(e).body())).encode()
        yield SSE_DONE.encode()
