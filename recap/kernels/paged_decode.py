"""Decode attention over the paged KV cache in one native call (csrc/paged_decode.c): fp32, one query per
row, read through the block tables with an online softmax.

At batch 1 the torch path (`paged_attention._decode_rows`: a gather of the row's blocks, a zero fill past
seq_len, SDPA with a mask) ran ~30 ops per attention layer, ~0.9 ms per layer of a 4-attention-layer hybrid.
Reference: `_decode_rows`; tests/kernels/test_paged_decode.py compares the two.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.native import load_library, loads


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load_library("paged_decode")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.recap_paged_decode.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, p, i64, p, i64, ctypes.c_float, p,
                                       ctypes.c_int]
    lib.recap_paged_decode.restype = i64
    return lib


@functools.cache
def paged_decode_available() -> bool:
    """Whether the library builds and loads here (linear_rows_available says why not, once)."""
    return loads(_lib)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [b, Hq, Dh] fp32 (one query per row, at position seq_len - 1), caches [blocks, bs, Hkv, Dh] fp32,
    tables [b, W] and seq_lens [b] int64 -> [b, Hq, Dh]: softmax(q k^T * scale) v over each row's visible keys
    (the last `window` positions, or all)."""
    b, hq, dh = q.shape
    nb, bs, hkv, dh_c = k_cache.shape
    if dh_c != dh or hq % hkv or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    for x in (q, k_cache, v_cache):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("paged_decode takes contiguous fp32 queries and caches")
    if tables.dtype != torch.int64 or seq_lens.dtype != torch.int64 or tables.stride(1) != 1:
        raise ValueError("paged_decode takes int64 block tables (rows contiguous) and seq_lens")
    if tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(f"paged_decode: {b} rows but tables {tuple(tables.shape)}, seq_lens {tuple(seq_lens.shape)}")
    out = torch.empty_like(q)
    bad = _lib().recap_paged_decode(
        q.data_ptr(), b, hq, hkv, dh, k_cache.data_ptr(), v_cache.data_ptr(), nb, bs, tables.data_ptr(),
        tables.stride(0), seq_lens.data_ptr(), window or 0, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise ValueError(f"paged_decode: {bad} (row, head) pairs read a block outside the cache's {nb} blocks")
    return out
