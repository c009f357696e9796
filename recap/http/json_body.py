"""Request bodies -> JSON objects, refusing what the standard library accepts but the server cannot serve.

`json.loads` takes NaN/Infinity (not JSON), numbers that overflow to infinity, escaped lone surrogates
("\\ud800": a str that cannot be encoded, so tokenizers and responses fail later), duplicate keys in an
object (the last would silently win: two `logit_bias` entries for one token, two `temperature`s) and any
nesting its recursion allows. Each is a 400 naming the place, before the body reaches a model: non-finite
numbers in the parser hooks, nesting past the recursion limit as the parser's RecursionError, then one walk
(an explicit stack, no recursion) checks the nesting depth, every string and every object's keys.
"""

from __future__ import annotations

import json
import math
from typing import Any

from recap.http.errors import APIError

DEFAULT_MAX_DEPTH = 64


def _bad_number(text: str) -> float:
    raise APIError(f"Invalid JSON body: {text} is not a finite number (NaN and Infinity are not JSON)",
                   code="invalid_json")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"Invalid JSON body: {text} overflows a 64-bit float", code="invalid_json")
    return value


class _Duplicated(dict):  # type: ignore[type-arg]
    """An object that named a key twice (the parser hook keeps the last value); `check_tree` refuses it with its
    place in the body."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.duplicate = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return _Duplicated(pairs, dup)


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "(body)"


def _check_str(s: str, where: tuple[str | int, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        name = _path(where)
        raise APIError(f"{name}: lone surrogate {s[e.start]!r} at character {e.start} (strings must be valid "
                       "Unicode text)", param=str(where[0]) if where else None, code="invalid_string") from None


def check_tree(data: Any, max_depth: int) -> None:
    """Raise APIError (400) for nesting deeper than `max_depth` or a string that is not valid Unicode."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(data, 1, ())]
    while stack:
        obj, depth, where = stack.pop()
        if isinstance(obj, str):
            _check_str(obj, where)
            continue
        if not isinstance(obj, (dict, list)):
            continue
        if depth > max_depth:
            raise APIError(f"{_path(where)}: JSON nested deeper than {max_depth} levels", param=str(where[0])
                           if where else None, code="too_deep")
        if isinstance(obj, _Duplicated):
            raise APIError(f"{_path((*where, obj.duplicate))}: duplicate key {obj.duplicate!r} in a JSON object",
                           param=str(where[0]) if where else obj.duplicate, code="duplicate_key")
        if isinstance(obj, dict):
            for k, v in obj.items():
                _check_str(k, (*where, k))
                stack.append((v, depth + 1, (*where, k)))
        else:
            stack.extend((v, depth + 1, (*where, i)) for i, v in enumerate(obj))


def parse_json(body: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """The request body as a JSON object; APIError (400) naming the problem otherwise."""
    try:
        data = json.loads(body, parse_constant=_bad_number, parse_float=_float, object_pairs_hook=_object)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"Invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(f"Invalid JSON body: nested deeper than {max_depth} levels", code="too_deep") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", code="invalid_json")
    check_tree(data, max_depth)
    return data
