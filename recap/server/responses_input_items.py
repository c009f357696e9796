"""GET /v1/responses/{id}/input_items: the input items a stored response was made from (its request's `input`,
a string input as the one user message it stands for), each with an id (the client's, else one recap assigns at
store time), in OpenAI's list shape: `order` desc (the default, newest first) or asc, `limit` 1-100 (default 20),
`after` an item id (the page after it), `first_id` / `last_id` / `has_more`. Items of earlier responses in a
`previous_response_id` chain are on those responses' own lists; `include` is refused (no listed item carries
logprobs), as any other query field is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from recap.http.errors import APIError
from recap.server.responses_api_objects import new_id
from recap.server.responses_api_request import InputItem

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(items: Sequence[InputItem]) -> tuple[dict[str, Any], ...]:
    """The request's input items as the list shows them (built once, when the response is stored)."""
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        data.setdefault("id", new_id(_ID_PREFIX[item.type]))
        if item.type != "reasoning":
            data.setdefault("status", "completed")
        out.append(data)
    return tuple(out)


def _query(request: Request) -> tuple[str, int, str | None]:
    q = request.query_params
    for name in q:
        if name not in ("order", "limit", "after"):
            raise APIError(f"{name}: not supported on this endpoint (recap takes order, limit and after)", param=name)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    raw = q.get("limit", str(DEFAULT_LIMIT))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise APIError(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}", param="limit")
    return order, int(raw), q.get("after")


def item_page(items: tuple[dict[str, Any], ...], request: Request) -> dict[str, Any]:
    """One page of a stored response's input items, as the query asks."""
    order, limit, after = _query(request)
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(f"after: no input item {after!r} in this response", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
