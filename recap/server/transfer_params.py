"""`kv_transfer_params` (vLLM's field) in the OpenAI endpoints: the app passes it to the hook of its role and
returns what the engine hands back. A single instance (no hook) refuses the field; a prefill or decode
instance gets its hook (recap.disagg.api) from whoever builds the app (recap.launch), so that this package
imports no disaggregation code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from starlette.requests import Request

from recap.engine.input_processor import PreparedRequest
from recap.engine.outputs import RequestOutput
from recap.http.errors import APIError
from recap.http.wire import KV_TRANSFER_PARAMS


class TransferHook(Protocol):
    def __call__(self, engine: Any, params: dict[str, Any], prepared: list[PreparedRequest], *, stream: bool,
                 n: int, request: Request) -> list[PreparedRequest]:
        """Validate `params` for this role and mark the prepared request; APIError (4xx) otherwise. `request`
        (its headers and client address) is who asked."""
        ...


def attach_transfer(hook: TransferHook | None, engine: Any, params: dict[str, Any] | None,
                    prepared: list[PreparedRequest], *, stream: bool, n: int, request: Request
                    ) -> list[PreparedRequest]:
    if params is None:
        return prepared
    if hook is None:
        raise APIError(f"{KV_TRANSFER_PARAMS}: this server is a single instance (start it with `recap serve "
                       "--role prefill|decode`)", param=KV_TRANSFER_PARAMS)
    return hook(engine, params, prepared, stream=stream, n=n, request=request)


def with_transfer_params(body: dict[str, Any], finals: Sequence[RequestOutput]) -> dict[str, Any]:
    """Add the prefill side's handle to a response body (unchanged for every other request)."""
    params = finals[0].kv_transfer_params if len(finals) == 1 else None
    if params is not None:
        body[KV_TRANSFER_PARAMS] = params
    return body
