"""Reading a safetensors file tensor by tensor, straight into the memory that keeps it.

safetensors' own reader maps the whole file and hands out a copy of each tensor: the mapped pages count as the
process's resident memory while the file is open (a shard's worth) and every tensor passes through a second
buffer. Here the header is parsed once (8-byte little-endian length, a JSON table of dtype, shape and byte
range per tensor; https://github.com/huggingface/safetensors) and each tensor is read with plain reads into
its destination: the model's own parameter where the file's dtype is the model's (no other copy), else one
tensor's buffer that is cast into it and freed.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20


class SafetensorsFormatError(ValueError):
    """A file that is not a well-formed safetensors file (its header, a dtype, a byte range)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def stored_tensors(f: BinaryIO, name: str) -> list[StoredTensor]:
    """The tensors of the open file `f` (named `name` in errors), in file order."""
    head = f.read(8)
    if len(head) != 8:
        raise SafetensorsFormatError(f"{name}: shorter than a safetensors header")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(f"{name}: a {size}-byte header")
    try:
        table = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"{name}: unreadable header ({e})") from e
    out = []
    for key, entry in table.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise SafetensorsFormatError(f"{name}: tensor {key!r} has an unknown dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise SafetensorsFormatError(f"{name}: tensor {key!r} spans {end - begin} bytes for {nbytes}")
        out.append(StoredTensor(key, dtype, shape, 8 + size + begin, nbytes))
    return sorted(out, key=lambda t: t.offset)


def read_into(f: BinaryIO, t: StoredTensor, dst: torch.Tensor, name: str) -> None:
    """The bytes of `t` into `dst` (contiguous, on the CPU, t's dtype and element count)."""
    assert dst.is_contiguous() and dst.device.type == "cpu" and dst.dtype == t.dtype and dst.nbytes == t.nbytes
    view = memoryview((ctypes.c_char * t.nbytes).from_address(dst.data_ptr())).cast("B") if t.nbytes else None
    f.seek(t.offset)
    done = 0
    while view is not None and done < t.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise SafetensorsFormatError(f"{name}: ends inside tensor {t.key!r}")
        done += n


def read_tensor(f: BinaryIO, t: StoredTensor, name: str) -> torch.Tensor:
    """`t` as a new tensor."""
    out = torch.empty(t.shape, dtype=t.dtype)
    read_into(f, t, out, name)
    return out


def copy_stored(f: BinaryIO, t: StoredTensor, dst: torch.Tensor, name: str) -> None:
    """`t` into `dst` (its shape): read in place where the dtypes match and dst is plain CPU memory, else read
    into a buffer of its own and cast into dst."""
    if dst.dtype == t.dtype and dst.is_contiguous() and dst.device.type == "cpu":
        read_into(f, t, dst, name)
    else:
        dst.copy_(read_tensor(f, t, name))
