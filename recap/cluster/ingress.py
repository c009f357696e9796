"""The OpenAI-compatible ingress in front of recap replicas on Ray Serve.

It does two things of its own and leaves the API to the replicas (which run the app their ReplicaAPI
builds, recap.cluster.api): tokenizes the prompt exactly as a replica would (the API's `prompt_tokens`),
so the router can hash its block chain, or pins a call about a stored response to the replica that stored
it (recap.cluster.route_input); and relays the request to the replica the router picks. A
replica that dies fails the requests it was serving with an OpenAI error body (503 before the response
started, an error event in a stream after), and Serve stops routing to it. `/debug/integrity` asks every
replica for its cache core's check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from recap.cluster.api import ReplicaAPI
from recap.cluster.asgi import REPLICA_HEADER, HTTPRequest, ResponseStart
from recap.cluster.board import replicas_of
from recap.cluster.ray_router import ROUTE_KWARG
from recap.cluster.route_input import route_input
from recap.cluster.router import POLICIES
from recap.http.errors import APIError
from recap.http.sse import SSE_DONE, sse_event
from recap.model.loader import load_tokenizer

log = logging.getLogger("recap.cluster")
REPLICA_DEPLOYMENT = "RecapReplica"
_DROP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


@dataclass(frozen=True)
class IngressConfig:
    tokenizer: str  # the replicas' tokenizer (folder or hub id): prompts are hashed as the replicas hash them
    chat_template: str | None = None  # the replicas' served template (`--chat-template`), if not the tokenizer's
    policy: str = "checkpoint"  # checkpoint | round_robin | load
    replica_app: str = "recap"  # the Serve app whose RecapReplica deployment serves the requests
    enable_debug: bool = False  # /debug/integrity (as `recap serve --enable-debug-endpoints` on the replicas)
    debug_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")


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
                  ) -> tuple[ResponseStart, bytes]:
    """The response start and the whole body of a small request."""
    async def run() -> tuple[ResponseStart, bytes]:
        start, chunks = ResponseStart(0, ()), []
        async for c in call_replica(handle, request, route):
            if isinstance(c, ResponseStart):
                start = c
            else:
                chunks.append(c)
        return start, b"".join(chunks)

    return await asyncio.wait_for(run(), timeout_s)


def replica_of(start: ResponseStart) -> str:
    """The id of the replica that answered."""
    return (start.header(REPLICA_HEADER) or b"").decode()


async def integrity_of(handle: DeploymentHandle, app: str, deployment: str, timeout_s: float) -> dict[str, Any]:
    """Each known replica's /debug/integrity by replica id (a call pinned to each). A replica that left
    between listing and asking is left out (its pinned call fell back to another replica, or failed)."""
    async def report(rid: str) -> tuple[str, Any]:
        start, content = await collect(handle, HTTPRequest("GET", "/debug/integrity"), {"pin": rid}, timeout_s)
        return replica_of(start), json.loads(content)

    ids = replicas_of(app, deployment)
    if not ids:  # the handle's router is built on first use
        await collect(handle, HTTPRequest("GET", "/health"), {"policy": "load"}, timeout_s)
        ids = replicas_of(app, deployment)
    reports = await asyncio.gather(*(report(rid) for rid in ids), return_exceptions=True)
    out: dict[str, Any] = {}
    for rid, answer in zip(ids, reports):
        if isinstance(answer, RayActorError):
            continue  # it died while answering
        if not isinstance(answer, tuple):
            out[rid] = {"ok": False, "error": repr(answer)}
        elif answer[0] == rid:
            out[rid] = answer[1]
    return out


def forwarded(request: Request, body: bytes) -> tuple[str, HTTPRequest]:
    """The path as the replicas serve it (at /, whatever the ingress's route prefix) and the request."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path, HTTPRequest(request.method, path, body, request.url.query.encode(),
                             tuple((k.lower(), v) for k, v in request.headers.raw))


async def read_request(request: Request, tokenizer: Any, api: ReplicaAPI, policy: str
                       ) -> tuple[str, HTTPRequest, dict[str, Any]]:
    """The path, the request to forward, and its route (recap.cluster.route_input). A POST's body is parsed,
    rendered and tokenized off the event loop: a long chat takes long enough to stall other requests."""
    body = await request.body()
    path, forward = forwarded(request, body)
    if request.method != "POST":  # no body is read: the path alone can pin it
        return path, forward, route_input(api, tokenizer, request.method, path, body, policy)
    route = await asyncio.to_thread(route_input, api, tokenizer, request.method, path, body, policy)
    return path, forward, route


def debug_off() -> Response:
    return APIError("Not Found", status=404, code="not_found").response()


class RecapIngress:
    """Serve deployment body (the app's HTTP entry point)."""

    def __init__(self, replicas: DeploymentHandle | None, config: IngressConfig, api: ReplicaAPI) -> None:
        self.config = config
        self.api = api
        self.tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        self.replicas = replicas or serve.get_deployment_handle(REPLICA_DEPLOYMENT, config.replica_app)

    async def __call__(self, request: Request) -> Response:
        path, forward, route = await read_request(request, self.tokenizer, self.api, self.config.policy)
        if path == "/debug/integrity" and request.method == "GET":
            return JSONResponse(await self.integrity()) if self.config.enable_debug else debug_off()
        return await relay(call_replica(self.replicas, forward, route), path)

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
        yield sse_event(replica_gone(e)).encode()
        yield SSE_DONE.encode()
