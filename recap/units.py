"""Byte sizes written by people: '72GB', '8GiB', '1.5e9', '64k' (decimal K/M/G/T, binary Ki/Mi/Gi/Ti)."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgt", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 10 ** (3 * _i)
    _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 2 ** (10 * _i)
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """'72GB' -> 72 * 10**9, '8GiB' -> 8 * 2**30, '1.5e9' -> 1500000000, '1024' -> 1024. Non-negative."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size must be non-negative, got {text}")
        return text
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {text!r}: a number with an optional unit, e.g. 72GB or 8GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def positive_bytes(text: str) -> int:
    """`parse_bytes` as an argparse type: a clear message, and zero refused (a pool of nothing)."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value
