"""The OpenAI-compatible ingress of a disaggregated deployment on Ray Serve (`recap serve --prefill-replicas P
--decode-replicas D`): what `recap proxy` does over HTTP, over DeploymentHandles.

Each POST /v1/completions or /v1/chat/completions goes first to a prefill replica, unstreamed, with
`kv_transfer_params: {"do_remote_decode": true}` (it computes the prompt, samples one token, holds the KV),
then to a decode replica with the handle it returned; the decode replica pulls the state checkpoints and
the KV blocks it lacks from that prefill replica (recap.cluster.ray_transport) and answers like a single
instance. Both calls are routed by recap's checkpoint-aware router on the prompt's hash chain: prefill
replicas by what they can resume, decode replicas by what they hold (a decode replica registers what it
receives, so a session's next turn finds its prefix there and asks for fewer blocks). The flow and its
errors are recap.disagg.flow's (the proxy runs the same, over HTTP): an error from either side passes
through; a replica that dies answers 503 (or, mid-stream, an error event), as in recap.cluster.ingress.
When the decode side did not answer 200 the held KV is released at once. Every other request goes to a
decode replica (a call about a stored response to the one that stored it, recap.cluster.route_input).
`/debug/integrity` reports every replica of both deployments.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from recap.cluster.api import ReplicaAPI
from recap.cluster.asgi import HTTPRequest
from recap.cluster.ingress import (
    call_replica,
    collect,
    debug_off,
    integrity_of,
    read_request,
    relay,
    replica_gone,
    replica_of,
)
from recap.cluster.ray_router import ROUTE_KWARG
from recap.cluster.ray_transport import parse_address
from recap.disagg.flow import Answer, prefill_then_decode, refuse_client_params, upstream_timeout
from recap.engine.errors import KVTransferError
from recap.http.errors import APIError
from recap.http.json_body import parse_json
from recap.http.wire import GENERATION_ROUTES, KV_API_KEY_HEADER
from recap.model.loader import load_tokenizer

log = logging.getLogger("recap.cluster")
PREFILL_DEPLOYMENT = "RecapPrefill"
DECODE_DEPLOYMENT = "RecapDecode"


@dataclass(frozen=True)
class PDIngressConfig:
    tokenizer: str  # the replicas' tokenizer: prompts are hashed as the replicas hash them
    chat_template: str | None = None  # the replicas' served template (`--chat-template`), if not the tokenizer's
    app: str = "recap"  # the Serve app holding both deployments
    enable_debug: bool = False
    timeout_s: float = 600.0  # the prefill call (the decode call streams: no overall limit)
    debug_timeout_s: float = 30.0
    kv_api_key: str = field(default="", repr=False)  # the prefill replicas' credential (recap.disagg.api)


class RecapPDIngress:
    """Serve deployment body (the disaggregated app's HTTP entry point)."""

    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle | None,
                 config: PDIngressConfig, api: ReplicaAPI) -> None:
        self.config = config
        self.api = api
        self.tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        self.prefill = prefill or serve.get_deployment_handle(PREFILL_DEPLOYMENT, config.app)
        self.decode = decode or serve.get_deployment_handle(DECODE_DEPLOYMENT, config.app)

    async def __call__(self, request: Request) -> Response:
        path, forward, route = await read_request(request, self.tokenizer, self.api, "checkpoint")
        if path == "/debug/integrity" and request.method == "GET":
            return JSONResponse(await self.integrity()) if self.config.enable_debug else debug_off()
        if request.method != "POST" or path not in GENERATION_ROUTES:
            return await relay(call_replica(self.decode, forward, route), path)
        try:
            data = parse_json(forward.body)
        except APIError:
            data = None
        if not isinstance(data, dict):  # the decode replica answers it with the single instance's 400
            return await relay(call_replica(self.decode, forward, route), path)
        try:
            refuse_client_params(data, "ingress")
            prefill = RayUpstream(self.prefill, "prefill", forward, route, self.config.timeout_s,
                                  ((KV_API_KEY_HEADER.encode(), self.config.kv_api_key.encode()),))
            return await prefill_then_decode(data, prefill, RayUpstream(self.decode, "decode", forward, route))
        except APIError as e:
            return e.response()

    async def integrity(self) -> dict[str, Any]:
        """Every prefill and decode replica's /debug/integrity, by role and replica id; ok when all are."""
        out: dict[str, Any] = {}
        for role, handle, deployment in (("prefill", self.prefill, PREFILL_DEPLOYMENT),
                                         ("decode", self.decode, DECODE_DEPLOYMENT)):
            reports = await integrity_of(handle, self.config.app, deployment, self.config.debug_timeout_s)
            out.update({f"{role}/{rid}": report for rid, report in reports.items()})
        roles = {key.split("/", 1)[0] for key in out}
        return {"ok": roles == {"prefill", "decode"} and all(r.get("ok") for r in out.values()), "replicas": out}


class RayUpstream:
    """The prefill or decode deployment, for one request (recap.disagg.flow.Upstream)."""

    hint = ""

    def __init__(self, handle: DeploymentHandle, side: str, request: HTTPRequest, route: dict[str, Any],
                 timeout_s: float | None = None, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.handle, self.side, self.request, self.route, self.timeout_s = handle, side, request, route, timeout_s
        self.headers = headers  # replace the client's of the same name
        self.name = f"the {side} replica"

    async def post(self, body: dict[str, Any]) -> Answer:
        try:
            start, content = await collect(self.handle, _with_body(self.request, body, self.headers), self.route,
                                           self.timeout_s)
        except RayActorError as e:
            raise replica_gone(e) from None
        except TimeoutError:
            raise upstream_timeout(self.name) from None
        media_type = (start.header(b"content-type") or b"application/json").decode("latin-1")
        origin = (f"x-recap-{self.side}-replica", replica_of(start))  # x-recap-prefill-replica on the response
        return Answer(start.status, content, media_type, (origin,))

    async def respond(self, body: dict[str, Any]) -> Response:
        request = _with_body(self.request, body, self.headers)
        return await relay(call_replica(self.handle, request, self.route), self.request.path)

    def release(self, handle: dict[str, Any]) -> None:
        """Let the prefill replica free the held KV at once (fire and forget)."""
        address, tid, mac = handle.get("remote_address"), handle.get("transfer_id"), handle.get("mac")
        if not (isinstance(address, str) and isinstance(tid, str) and isinstance(mac, str)):
            return
        try:
            _, _, replica = parse_address(address)
        except KVTransferError:
            return
        self.handle.options(method_name="kv_release").remote(tid, mac, **{ROUTE_KWARG: {"pin": replica}})


def _with_body(request: HTTPRequest, data: dict[str, Any], extra: tuple[tuple[bytes, bytes], ...] = ()
               ) -> HTTPRequest:
    body = json.dumps(data).encode()
    replaced = {b"content-length", *(k for k, _ in extra)}
    headers = tuple((k, v) for k, v in request.headers if k not in replaced)
    return HTTPRequest(request.method, request.path, body, request.query,
                       headers + extra + ((b"content-length", str(len(body)).encode()),))
