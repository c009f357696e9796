"""`--api-key`: every /v1 route wants `Authorization: Bearer KEY`, as vLLM's does (and /debug, which vLLM
lacks); everything else (/health, /metrics, ...) stays open, as in vLLM, and so do CORS preflights
(OPTIONS). The comparison takes the same time whatever the key sent."""

from __future__ import annotations

import hmac

from recap.http.errors import APIError

PROTECTED = ("/v1/", "/debug/")


def needs_key(method: str, path: str) -> bool:
    return method != "OPTIONS" and (path + "/").startswith(PROTECTED)


def check_key(api_key: str, authorization: bytes | None) -> None:
    """Raise a 401 unless the Authorization header is `Bearer <api_key>`."""
    sent = authorization or b""
    if not hmac.compare_digest(sent, b"Bearer " + api_key.encode()):
        raise APIError("Unauthorized: send the server's API key as `Authorization: Bearer KEY`", status=401,
                       type="authentication_error", code="invalid_api_key")
