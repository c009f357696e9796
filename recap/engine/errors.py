"""Typed errors the API layers map to client errors (HTTP 4xx)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (bad parameters, too long, unknown tokens)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can make progress."""
