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

from recap.cluster.asgi import HTTPRequest, ResponseStart
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


class RecapIngress:
    """Serve deployment body (the app's HTTP entry point)."""

    def __init__(self, replicas: DeploymentHandle | None, config: IngressConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.replicas = replicas or serve.get_deployment_handle(REPLICA_DEPLOYMENT, config.replica_app)

    def _call(self, request: HTTPRequest, route: dict[str, Any]) -> Any:
        return self.replicas.options(stream=True).http.remote(request, **{ROUTE_KWARG: route})

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):  # an app under a route prefix: the replicas serve at /
            path = path[len(root):] or "/"
        if path == "/debug/integrity" and request.method == "GET":
            return JSONResponse(await self.integrity())
        tokens, salt = prompt_tokens(self.tokenizer, path, body) if request.method == "POST" else ([], None)
        forwarded = HTTPRequest(request.method, path, body, request.url.query.encode(),
                                tuple((k.lower(), v) for k, v in request.headers.raw))
        stream = self._call(forwarded, {"tokens": tokens, "cache_salt": salt, "policy": self.config.policy})
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

    async def integrity(self) -> dict[str, Any]:
        """Every known replica's /debug/integrity, by replica id; ok when all are."""
        ids = replicas_of(self.config.replica_app)
        if not ids:  # the handle's router is built on first use
            await self._collect(HTTPRequest("GET", "/health"), {"policy": "load"})
            ids = replicas_of(self.config.replica_app)
        reports = await asyncio.gather(*(self._collect(HTTPRequest("GET", "/debug/integrity"), {"pin": rid})
                                         for rid in ids), return_exceptions=True)
        out: dict[str, Any] = {}
        for rid, report in zip(ids, reports):
            out[rid] = report if isinstance(report, dict) else {"ok": False, "error": repr(report)}
        return {"ok": bool(out) and all(r.get("ok") for r in out.values()), "replicas": out}

    async def _collect(self, request: HTTPRequest, route: dict[str, Any]) -> Any:
        async def run() -> Any:
            chunks = [c async for c in self._call(request, route) if isinstance(c, bytes)]
            return json.loads(b"".join(chunks))

        return await asyncio.wait_for(run(), self.config.debug_timeout_s)


async def _relay_events(stream: Any) -> Any:
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as e:  # the 200 is out: report in-stream, as the replicas do
        log.warning("replica died mid-stream: %r", e)
        yield sse(json.dumps(replica_gone(e).body())).encode()
        yield SSE_DONE.encode()
