"""Prefill, then decode: the one flow behind `recap proxy` (upstreams over HTTP, recap.disagg.proxy) and the
Ray P/D ingress (upstreams over DeploymentHandles, recap.cluster.pd_ingress), so that what each failure
returns is written once.

The client's body goes to a prefill upstream first, unstreamed, with `kv_transfer_params:
{"do_remote_decode": true}` (it computes the prompt, samples one token, holds the KV and answers with the
handle), then to a decode upstream with that handle and `"do_remote_prefill": true`; the decode side's
response is the client's. What the client gets otherwise:
- it set kv_transfer_params itself: a 400 (`refuse_client_params`);
- the prefill upstream is unreachable or gone: that upstream's error (HTTP: a 502; Ray: a 503); it timed
  out: a 504 upstream_timeout (`upstream_timeout`);
- the prefill side answered an error: its OpenAI error body passes through, any other body is a 502
  upstream_failed (`error_answer`);
- its 200 carries no handle: a 502 upstream_bad_response;
- the decode side's answer as its upstream renders it (over HTTP a refused handle is the front end's
  doing, a 502 kv_transfer_refused: `error_answer(..., refusal=True)`; over Ray it is relayed as is).
Whenever the decode side did not answer 200 (it failed, refused, or the client left and the flow was
cancelled) the prefill side is told to release the held KV at once, not after its hold timeout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response

from recap.http.errors import APIError
from recap.http.wire import KV_TRANSFER_PARAMS


@dataclass(frozen=True)
class Answer:
    """An upstream's unstreamed answer."""

    status: int
    content: bytes
    media_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()  # for the client's final response (Ray: which prefill replica)


class Upstream(Protocol):
    """A prefill or decode instance (HTTP) or deployment (Ray) that the flow calls."""

    name: str  # as the client's error messages name it: "the prefill instance at URL", "the prefill replica"
    hint: str  # appended to the message when a prefill answer carries no handle

    async def post(self, body: dict[str, Any]) -> Answer:
        """An unstreamed call; APIError when the upstream is unreachable, gone or timed out."""
        ...

    async def respond(self, body: dict[str, Any]) -> Response:
        """The client's response from this side (streamed when `body` asks for it)."""
        ...

    def release(self, handle: dict[str, Any]) -> None:
        """Let this (prefill) side free the KV it holds for `handle` now (fire and forget)."""
        ...


def refuse_client_params(body: dict[str, Any], front: str) -> None:
    """A 400 when the client sets the field the front end (the proxy, the ingress) sets."""
    if KV_TRANSFER_PARAMS in body:
        raise APIError(f"{KV_TRANSFER_PARAMS} is set by the {front}, not by clients", param=KV_TRANSFER_PARAMS)


def upstream_timeout(name: str) -> APIError:
    return APIError(f"{name} timed out", status=504, type="upstream_error", code="upstream_timeout")


def passthrough(answer: Answer) -> Response:
    return Response(answer.content, status_code=answer.status, media_type=answer.media_type)


def _error_of(content: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body, or None."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


def error_answer(name: str, answer: Answer, *, refusal: bool) -> Response:
    """An upstream's non-200 answer for the client: an OpenAI error body passes through, except (with
    `refusal`, a decode side) a refusal of the transfer handle the front end sent (a 502 kv_transfer_refused
    with its reason); any other answer (a bare 500, an HTML page) becomes a 502 with a JSON error body."""
    error = _error_of(answer.content)
    refused = refusal and error is not None and (error.get("param") == KV_TRANSFER_PARAMS
                                                 or error.get("code") == "kv_transfer_refused")
    if error is not None and not refused:  # an OpenAI error body (a 4xx, or the upstream's own 502/504)
        return passthrough(answer)
    reason = str(error.get("message")) if error is not None else answer.content[:500].decode(errors="replace")
    if refused:
        return APIError(f"{name} refused the KV transfer handle ({answer.status}): {reason}", status=502,
                        type="upstream_error", code="kv_transfer_refused").response()
    return APIError(f"{name} failed ({answer.status}): {reason}", status=502, type="upstream_error",
                    code="upstream_failed").response()


def _handle(answer: Answer) -> Any:
    try:
        return json.loads(answer.content).get(KV_TRANSFER_PARAMS)
    except (ValueError, AttributeError):  # not JSON, or not an object
        return None


async def prefill_then_decode(body: dict[str, Any], prefill: Upstream, decode: Upstream) -> Response:
    """The client's response to `body` (already checked by `refuse_client_params`)."""
    first = {k: v for k, v in body.items() if k != "stream_options"}
    first.update(stream=False, **{KV_TRANSFER_PARAMS: {"do_remote_decode": True}})
    prefilled = await prefill.post(first)
    if prefilled.status != 200:
        return error_answer(prefill.name, prefilled, refusal=False)
    handle = _handle(prefilled)
    if not isinstance(handle, dict):
        raise APIError(f"{prefill.name} returned no {KV_TRANSFER_PARAMS}{prefill.hint}", status=502,
                       type="upstream_error", code="upstream_bad_response")
    second = {**body, KV_TRANSFER_PARAMS: {**handle, "do_remote_prefill": True}}
    answered = False
    try:
        response = await decode.respond(second)
        answered = response.status_code == 200  # a 200 from the decode side comes after its pull
        for key, value in prefilled.headers:
            response.headers[key] = value
        return response
    finally:
        if not answered:  # the decode side failed, refused or was left: nobody will pull
            prefill.release(handle)
