"""RMS norm of fp32 rows in one native call (csrc/rms_norm.c), at every row count.

torch ran RMSNorm's 7 small ops in ~13 us at one row (their dispatch, not their arithmetic); a decode step of a
24-layer hybrid calls ~50 norms. Prefill runs the same kernel, not torch's ops, because the two round
differently: a prefill row and the decode step of the same token must give the same bits, or a checkpoint written
by a decode step differs from the state a caching-off prefill computes. A one-ulp difference is harmless until a
quantized linear meets an exact tie: an int8 embedding's rows (max |q| = 127) normalized by a flat norm weight land
on half steps of AVX2's 7-bit activation grid, and tied values round either way (measured: caching-on log-probs
off by 0.03-0.09 on every prompt tried, before this). Reference: `rms_norm_rows_ref` (layers/norm.py's torch ops).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.native import load_library, loads


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load_library("rms_norm")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.recap_rms_norm_f32.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    lib.recap_rms_norm_f32.restype = None
    lib.recap_rms_norm_offset_f32.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    lib.recap_rms_norm_offset_f32.restype = None
    return lib


@functools.cache
def rms_norm_available() -> bool:
    """Whether the library builds and loads here (linear_rows_available says why not, once)."""
    return loads(_lib)


def use_rms_norm_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Contiguous fp32 rows and an fp32 weight of their width."""
    return (
        x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_contiguous()
        and weight.shape[0] == x.shape[-1]
    )  # fmt: skip


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] fp32 contiguous (use_rms_norm_rows), weight [d] -> x / rms(x) * weight, a new tensor (rows
    split across torch's OpenMP threads when many)."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    _lib().recap_rms_norm_f32(x.data_ptr(), x.numel() // d, d, weight.data_ptr(), eps, y.data_ptr())
    return y


def rms_norm_offset_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] fp32 contiguous, weight [d] -> x / rms(x) * (1 + weight) (a zero-centred norm's), a new tensor.
    Reference: layers/norm.py's OffsetRMSNorm torch ops."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    _lib().recap_rms_norm_offset_f32(x.data_ptr(), x.numel() // d, d, weight.data_ptr(), eps, y.data_ptr())
    return y


def rms_norm_rows_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain reference: RMSNorm's torch ops."""
    ms = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(ms + eps) * weight
