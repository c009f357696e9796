"""The OpenAI app's error mapping: pydantic and engine validation errors -> a 400 naming the request field
(the error body and the generic mapping: recap.http.errors)."""

from __future__ import annotations

import re

from pydantic import ValidationError

from recap.http import errors as http_errors
from recap.http.errors import APIError
from recap.http.sse import sse_event
from recap.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from recap.server.responses_api_request import ResponsesRequest

# Union members pydantic appends to an error location ('str', 'list[int]', ...): not field names.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]]|^function-")
_FIELDS = (
    set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(ChatMessage.model_fields)
    | set(ResponsesRequest.model_fields) | {"top_k", "top_p"}
)


# Engine messages that do not start with the field they are about.
_PARAM_BY_PREFIX = (
    ("stop token id", "stop_token_ids"), ("stop strings", "stop"), ("token id", "prompt"),
    ("this model's maximum context length", "max_tokens"),
)


def _param_from_message(message: str) -> str | None:
    for prefix, param in _PARAM_BY_PREFIX:
        if message.startswith(prefix):
            return param
    word = re.match(r"[A-Za-z_]+", message)
    return word.group(0) if word and word.group(0) in _FIELDS else None


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            out += f".{part}" if out else part
    return out


def from_validation_error(err: ValidationError) -> APIError:
    """One 400 naming the offending fields: all unknown fields at once, else the first bad value."""
    errors = err.errors(include_url=False)
    extra = [_loc(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return APIError(f"Unsupported field(s): {', '.join(extra)}", param=extra[0], code="unsupported_field")
    first = _loc(errors[0]["loc"])
    msgs: list[str] = []
    for e in errors:  # a union reports one error per alternative: join them
        if _loc(e["loc"]) == first:
            m = str(e["msg"]).removeprefix("Value error, ")
            if m not in msgs:
                msgs.append(m)
    message = " or ".join(msgs)
    if not first:
        return APIError(message, param=_param_from_message(message))
    return APIError(f"{first}: {message}", param=first)


def from_value_error(err: ValueError) -> APIError:
    """Engine-side validation (SamplingParams, InvalidRequestError): a 400 with the engine's message."""
    message = str(err) or type(err).__name__
    return APIError(message, param=_param_from_message(message))


def from_exception(err: BaseException) -> APIError:
    """recap.http.errors.from_exception, naming the request field of a validation error."""
    return http_errors.from_exception(err, from_value_error)


def sse_error(err: Exception) -> str:
    """An error after the 200 went out: an OpenAI error body as one event (the stream then ends)."""
    return sse_event(from_exception(err))
