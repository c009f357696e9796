"""What the ingress hands the router for one request (recap.cluster.ray_router's `route` keyword).

A call about a stored response (POST /v1/responses with `previous_response_id`, or any call on
/v1/responses/{id}) is pinned to the replica whose id that response's id carries (recap.http.response_ids):
only that replica's store holds it, and a follow-up's prompt is the stored conversation, whose checkpoints
are on that very replica, so the pin is the cache's choice too. A pin to a replica that is gone falls back to
load (recap.cluster.router), and the replica that gets the call answers the usual 400 / 404. Every other
request is routed by its first prompt's tokens and cache salt, read by the replicas' API.
"""

from __future__ import annotations

from typing import Any

from recap.cluster.api import ReplicaAPI
from recap.http.errors import APIError
from recap.http.json_body import parse_json
from recap.http.response_ids import tag_of
from recap.http.wire import RESPONSES_ROUTE


def stored_response_id(method: str, path: str, body: bytes) -> str | None:
    """The stored response a call needs, by its id, or None. Parses a Responses POST's body (with the replicas'
    own limits on depth and numbers): run it off the event loop for a POST."""
    if path.startswith(RESPONSES_ROUTE + "/"):
        rid = path[len(RESPONSES_ROUTE) + 1:].split("/", 1)[0]
        return rid or None
    if method != "POST" or path != RESPONSES_ROUTE:
        return None
    try:
        data = parse_json(body)
    except APIError:  # the replica answers it with the proper 400
        return None
    rid = data.get("previous_response_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) else None


def pinned_replica(method: str, path: str, body: bytes) -> str | None:
    """The replica a call must reach (the one holding the stored response it names), or None."""
    rid = stored_response_id(method, path, body)
    return tag_of(rid) if rid is not None else None


def route_input(api: ReplicaAPI, tokenizer: Any, method: str, path: str, body: bytes, policy: str) -> dict[str, Any]:
    """The router's input for a request: a pin, else the first prompt's tokens and cache salt (none for a
    call without a body to read). Parses and tokenizes: a POST's runs off the event loop."""
    pin = pinned_replica(method, path, body)
    if pin is not None:
        return {"pin": pin, "policy": policy}
    tokens, salt = api.prompt_tokens(tokenizer, path, body) if method == "POST" else ([], None)
    return {"tokens": tokens, "cache_salt": salt, "policy": policy}
