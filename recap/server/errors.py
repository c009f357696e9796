"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, and what maps to them."""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from recap.engine.errors import EngineDeadError, InvalidRequestError, KVTransferError
from recap.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

# Union members pydantic appends to an error location ('str', 'list[int]', ...): not field names.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]]|^function-")
_FIELDS = (
    set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(ChatMessage.model_fields)
    | {"top_k", "top_p"}
)


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with `status`."""

    def __init__(
        self, message: str, *, status: int = 400, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        message = message.encode("utf-8", "backslashreplace").decode()  # echoed input may hold lone surrogates
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = None if param is None else param.encode("utf-8", "backslashreplace").decode()
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
    if isinstance(err, APIError):
        return err
    if isinstance(err, EngineDeadError):
        return APIError(str(err), status=503, type="service_unavailable", code="engine_dead")
    if isinstance(err, KVTransferError):
        code = "kv_transfer_timeout" if err.status == 504 else "kv_transfer_failed"
        return APIError(str(err), status=err.status, type="upstream_error", code=code)
    if isinstance(err, (InvalidRequestError, ValueError)):
        return from_value_error(err)
    return APIError(f"internal error: {type(err).__name__}: {err}", status=500, type="internal_error")
