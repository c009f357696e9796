"""`kv_transfer_params` in the OpenAI endpoints (vLLM's field name): what each role accepts and returns.

A prefill instance takes `{"do_remote_decode": true}` only from its front end (the proxy, the Ray P/D
ingress): the request carries the deployment's KV credential in the `x-kv-api-key` header (--kv-api-key, or
derived from the shared secret), else a 401 before anything is queued. It computes the prompt, samples one
token, holds the KV for a pull and answers with the handle under `kv_transfer_params`; holds past the
engine's caps are a 429 (recap.disagg.engine). A decode instance takes
that handle plus `"do_remote_prefill": true` and answers like a single instance (plain or streamed).
A single instance (role both) refuses the field (recap.server.transfer_params: `attach_transfer` here is
the hook of the other roles). The decode side trusts only handles its prefill peers signed for this very
prompt, unexpired and unused (recap.disagg.trust): any other is a 403, before anything is queued or any
connection made. Disaggregated requests have one prompt and n = 1, and no logprobs (the first token's
logprob stays on the prefill side): anything else is a 400.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from starlette.requests import Request

from recap.disagg.config import RemoteDecode, RemoteHandle
from recap.disagg.trust import HandleRefused
from recap.engine.input_processor import PreparedRequest
from recap.http.errors import APIError
from recap.http.wire import KV_API_KEY_HEADER, KV_TRANSFER_PARAMS


def _refuse(message: str) -> APIError:
    return APIError(f"{KV_TRANSFER_PARAMS}: {message}", param=KV_TRANSFER_PARAMS)


def attach_transfer(
    engine: Any, params: dict[str, Any], prepared: list[PreparedRequest], *, stream: bool, n: int, request: Request
) -> list[PreparedRequest]:
    """The OpenAI app's transfer hook for a prefill or decode instance (recap.server.transfer_params):
    validate `kv_transfer_params` for this server's role and mark the prepared request; 400 otherwise."""
    role = engine.kv_role
    assert role in ("prefill", "decode"), f"the transfer hook serves a prefill or decode engine, not {role!r}"
    if len(prepared) != 1 or n != 1:
        raise _refuse("a disaggregated request has exactly one prompt and n = 1")
    p = prepared[0]
    if p.params.logprobs is not None:
        raise _refuse("logprobs are not supported with disaggregated prefill")
    if role == "prefill":
        _check_credential(engine.transfer_config.kv_api_key, request)
        if params != {"do_remote_decode": True}:
            raise _refuse('a prefill instance takes {"do_remote_decode": true}')
        if stream:
            raise _refuse("a prefill request is not streamed")
        client = request.client.host if request.client is not None else ""
        return [dataclasses.replace(p, kv_transfer=RemoteDecode(client))]
    try:
        handle = RemoteHandle.from_params(params)
    except ValueError as e:
        raise _refuse(str(e)) from None
    block_size = engine.config.cache.block_size
    if handle.block_size != block_size:
        raise _refuse(f"the prefill instance uses block size {handle.block_size}, this one {block_size}")
    try:  # last: a handle that passes is marked used
        engine.verifier.verify(handle.signed_fields(), handle.mac, p.prompt_token_ids, p.cache_salt)
    except HandleRefused as e:
        raise APIError(f"{KV_TRANSFER_PARAMS}: {e}", status=403, type="permission_error", param=KV_TRANSFER_PARAMS,
                       code="kv_transfer_refused") from None
    return [dataclasses.replace(p, kv_transfer=handle)]


def _check_credential(expected: str, request: Request) -> None:
    """A 401 unless the request carries the front end's KV credential (compared in constant time)."""
    given = request.headers.get(KV_API_KEY_HEADER, "")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(f"{KV_TRANSFER_PARAMS}: do_remote_decode is taken only from this deployment's front end "
                       f"(the {KV_API_KEY_HEADER} header: --kv-api-key, or derived from the shared secret)",
                       status=401, type="authentication_error", param=KV_TRANSFER_PARAMS, code="kv_api_key_invalid")
