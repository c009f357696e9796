"""A request body -> a validated pydantic model, under the server's limits, off the event loop when large.

JSON is parsed by hand (recap.http.json_body: depth, NaN, surrogates) and checked against the limits
before pydantic sees it, so every bad input gets the same OpenAI-style 4xx body.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from recap.http.limits import ServerLimits, parse_body
from recap.server.errors import from_validation_error
from recap.server.serving import ServerState

M = TypeVar("M", bound=BaseModel)


def validate_body(body: bytes, model: type[M], limits: ServerLimits) -> M:
    data = parse_body(body, limits)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def parse_request(request: Request, model: type[M], state: ServerState) -> M:
    body = await request.body()
    return await state.offload.run(len(body), validate_body, body, model, request.app.state.limits)
