"""Typed errors the API layers map to client errors (HTTP 4xx), and the engine's start-up refusal."""

from recap.runner.host_memory import MemoryPlanError

__all__ = ["BusyError", "EngineDeadError", "InvalidRequestError", "KVTransferError", "MemoryPlanError",
           "StepFailedError"]


class InvalidRequestError(ValueError):
    """The request cannot be served as given (bad parameters, too long, unknown tokens)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can make progress."""


class StepFailedError(RuntimeError):
    """A step this request ran in raised, and so did its retry alone (core/step_faults.py): only it fails (500);
    the engine goes on."""


class KVTransferError(RuntimeError):
    """A disaggregated request's KV transfer failed: `status` is 502 (the prefill side is unreachable,
    went away or refused) or 504 (it timed out). Only that request fails."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class BusyError(RuntimeError):
    """No room for this request now (a capped resource is in use); the client may retry later (429)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
