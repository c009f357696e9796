"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, the exceptions that map to
them, and the exception handlers every recap app installs (the OpenAI app, the proxy)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from recap.engine.errors import BusyError, EngineDeadError, InvalidRequestError, KVTransferError, StepFailedError


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


def plain_value_error(err: ValueError) -> APIError:
    """A 400 with the error's message and no param (the OpenAI app names the param: recap.server.errors)."""
    return APIError(str(err) or type(err).__name__)


def from_exception(err: BaseException, value_error: Callable[[ValueError], APIError] = plain_value_error
                   ) -> APIError:
    """Any exception as the error its request gets; `value_error` renders engine-side validation (a 400)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, EngineDeadError):
        return APIError(str(err), status=503, type="service_unavailable", code="engine_dead")
    if isinstance(err, StepFailedError):
        return APIError(str(err), status=500, type="internal_error", code="step_failed")
    if isinstance(err, BusyError):
        return APIError(str(err), status=429, type="rate_limit_error", code=err.code)
    if isinstance(err, KVTransferError):
        code = "kv_transfer_timeout" if err.status == 504 else "kv_transfer_failed"
        return APIError(str(err), status=err.status, type="upstream_error", code=code)
    if isinstance(err, (InvalidRequestError, ValueError)):
        return value_error(err)
    return APIError(f"internal error: {type(err).__name__}: {err}", status=500, type="internal_error")


def add_error_handlers(app: FastAPI, log: logging.Logger, level: int, what: str) -> None:
    """An APIError as its OpenAI body (logged at `level` as `what (status): message`), and Starlette's own
    HTTP errors (404, 405) as OpenAI bodies too."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        log.log(level, "%s (%d): %s", what, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), status=exc.status_code, code="not_found" if exc.status_code == 404 else None
                        ).response()
