"""The disk tier's file format: one file per entry, self-describing and checksummed. Bytes only (no torch).

  magic      8 bytes  b"RECAPTR1"
  header_len 4 bytes  little-endian
  header     JSON: kind, chain hash (hex), position, the model identity digest, and per tensor its name,
             dtype, shape and byte length, in payload order
  payload    the tensors' raw bytes, concatenated
  checksum   8 bytes  xxh3-64 of everything before it, little-endian

A file is valid only if its size, magic, checksum, identity and key all agree with what the reader expects,
so a truncated file, a flipped byte or a file of another model (copied into the wrong directory) is
rejected (`TierFileError`), never loaded. Writes are atomic (`write_atomic`: a temporary file, fsync,
rename, directory fsync), so a crash mid-write leaves at most a temporary file, removed at the next scan.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"RECAPTR1"
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
TMP_SUFFIX = ".tmp"


class TierFileError(ValueError):
    """A file that must not be loaded: truncated, corrupt, foreign, or for another entry."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True)
class EntryHeader:
    kind: int  # recap.core.tier_index.EntryKind
    block_hash: int
    position: int
    identity: str  # the model identity digest (runner/disk_tier.model_identity)
    tensors: tuple[TensorMeta, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    def to_json(self) -> bytes:
        return json.dumps({
            "kind": self.kind, "hash": f"{self.block_hash:032x}", "position": self.position, "identity": self.identity,
            "tensors": [[t.name, t.dtype, list(t.shape), t.num_bytes] for t in self.tensors],
        }, separators=(",", ":")).encode()  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes) -> EntryHeader:
        try:
            d: dict[str, Any] = json.loads(raw)
            tensors = tuple(TensorMeta(str(n), str(dt), tuple(int(x) for x in shape), int(nb))
                            for n, dt, shape, nb in d["tensors"])  # fmt: skip
            return cls(int(d["kind"]), int(d["hash"], 16), int(d["position"]), str(d["identity"]), tensors)
        except (ValueError, KeyError, TypeError) as e:
            raise TierFileError(f"unreadable header: {e}") from None


def encode(header: EntryHeader, payload: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The file's pieces, in order (written one after another: no copy of the payload is joined)."""
    raw = header.to_json()
    head = MAGIC + _LEN.pack(len(raw)) + raw
    digest = xxhash.xxh3_64(head)
    for piece in payload:
        digest.update(piece)
    return [head, *payload, _SUM.pack(digest.intdigest())]


def read_header(path: Path) -> tuple[EntryHeader, int]:
    """The header and the offset of the payload, checking the file's size (not its checksum: `decode` does)."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + _LEN.size)
        if len(start) < len(MAGIC) + _LEN.size or start[: len(MAGIC)] != MAGIC:
            raise TierFileError("not a recap tier file (bad magic or truncated)")
        (n,) = _LEN.unpack_from(start, len(MAGIC))
        raw = f.read(n)
    if len(raw) != n:
        raise TierFileError("truncated header")
    header = EntryHeader.from_json(raw)
    offset = len(MAGIC) + _LEN.size + n
    if path.stat().st_size != offset + header.payload_bytes + _SUM.size:
        raise TierFileError("file size disagrees with its header (truncated or padded)")
    return header, offset


def decode(
    data: bytes | bytearray, identity: str, kind: int, block_hash: int, position: int
) -> tuple[EntryHeader, memoryview]:
    """Verify a whole file's bytes against the entry the reader expects; the header and the payload's bytes."""
    head = len(MAGIC) + _LEN.size
    if len(data) < head + _SUM.size or data[: len(MAGIC)] != MAGIC:
        raise TierFileError("not a recap tier file (bad magic or truncated)")
    (checksum,) = _SUM.unpack_from(data, len(data) - _SUM.size)
    if xxhash.xxh3_64_intdigest(memoryview(data)[: len(data) - _SUM.size]) != checksum:
        raise TierFileError("checksum mismatch (corrupt or truncated)")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    header = EntryHeader.from_json(data[head : head + n])
    if header.identity != identity:
        raise TierFileError("written by another model identity")
    if (header.kind, header.block_hash, header.position) != (kind, block_hash, position):
        raise TierFileError("holds another entry than its name says")
    payload = memoryview(data)[head + n : len(data) - _SUM.size]
    if len(payload) != header.payload_bytes:
        raise TierFileError("payload size disagrees with its header")
    return header, payload


def write_atomic(path: Path, pieces: list[bytes | memoryview]) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, fsync the directory. Raises OSError."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
