"""Chained block hashes: the identity of a prefix.

h[i] = H(h[i-1], tokens of block i), with h[-1] = H(cache salt, extra keys). Folding the request-wide
extra keys into the chain root is the same as hashing them into every block (the chain carries them),
and costs nothing per block. H is xxh3-128 over a stable byte encoding, so hashes agree across
processes and machines (never Python's `hash()`, which is salted per process).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

from recap.core.request import Request

_DOMAIN = b"recap.block.v1"


def _encode(value: Any, out: bytearray) -> None:
    """Tag-length-value encoding of a key: unambiguous, and stable across processes."""
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out += b"B1" if value else b"B0"
    elif isinstance(value, int):
        text = str(value).encode()
        out += b"I%d:" % len(text) + text
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"S%d:" % len(raw) + raw
    elif isinstance(value, bytes):
        out += b"Y%d:" % len(value) + value
    elif isinstance(value, float):
        text = value.hex().encode()
        out += b"F%d:" % len(text) + text
    elif isinstance(value, tuple | list):
        out += b"T%d:" % len(value)
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"extra key of type {type(value).__name__} has no stable hash encoding")


def root_hash(cache_salt: str | None, extra_keys: Sequence[Any] = ()) -> int:
    """The chain root for a request: differs for every (salt, extra keys) pair."""
    buf = bytearray(_DOMAIN)
    _encode(cache_salt, buf)
    _encode(tuple(extra_keys), buf)
    return xxhash.xxh3_128_intdigest(bytes(buf))


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block chained to its parent's hash."""
    return _chain_step(parent, array("q", token_ids).tobytes())


def _chain_step(parent: int, block_bytes: bytes) -> int:
    """The one byte encoding of a chain step: parent hash, then the block's tokens as int64."""
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + block_bytes)


def chain_hashes(root: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids` (a convenience for tests and tools)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockHasher:
    """Extends `Request.block_hashes` to cover every full block of the request's known tokens.

    Side effects: appends to `request.block_hashes`. Each block is hashed once, when it becomes full.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def update(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt, request.extra_keys)
        # One conversion for all new blocks, then block_hash's chain step per slice: the same hashes.
        data = array("q", request.token_slice(len(hashes) * bs, num_full * bs)).tobytes()
        step = 8 * bs
        for offset in range(0, len(data), step):
            parent = _chain_step(parent, data[offset : offset + step])
            hashes.append(parent)
