"""The "int4" linear backend: group-wise 4-bit weights (recap/kernels/linear_int4.py) behind LinearImpl.

Its own module because layers/linear.py is at its line budget; linear.py imports it where a layer switches to
"int4" (this module imports linear.py's LinearImpl).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from recap.kernels.linear_int4 import (
    Int4Weight,
    int4_graph_call,
    int4_linear,
    int4_linear_ref,
    int4_native_available,
    quantize_int4,
)
from recap.model.capture import NativeCall
from recap.model.layers.linear import LinearImpl

# The format (benchmarks/bench_int4.py, docs/performance.md): symmetric codes in groups of 32 inputs; the backend
# "int4_k" (quantization="int4_k") takes the super-block format instead (kernels/int4_superblock.py).
INT4_GROUP, INT4_ASYM = 32, False
INT4_SYM_FIT = "weighted"  # how symmetric scales are picked (kernels/linear_int4.SYM_FITS; docs/performance.md)


class Int4Linear(LinearImpl):
    """Group-wise 4-bit weights: the native kernel at every row count where it builds, its torch reference
    elsewhere (equal results), whether the native kernels are on or off (it is this backend's kernel). Only the
    packed form is kept: the constructor quantizes `weight` (or takes `quantized`, a checkpoint's own codes:
    model/prequantized_int4.py) and nothing reads it afterwards (the Linear releases it). importance [in]: the
    fit weighs each weight's error by its input channel's value too (model/importance.py)."""

    name = "int4"
    owns_weight = True

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, quantized: Int4Weight | None = None,
                 superblock: bool = False, importance: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__(weight, bias)
        if quantized is not None and (quantized.out_features, quantized.in_features) != tuple(weight.shape):
            raise ValueError(f"a packed {quantized.out_features} x {quantized.in_features} weight for a layer of "
                             f"{tuple(weight.shape)}")  # fmt: skip
        if quantized is None:
            group, asym = (32, False) if superblock else (INT4_GROUP, INT4_ASYM)
            quantized = quantize_int4(weight, group, asym, bias, superblock=superblock, sym_fit=INT4_SYM_FIT,
                                      importance=importance)  # fmt: skip
        self.quantized: Int4Weight = quantized
        self.name = "int4_k" if quantized.superblock else "int4"  # the backend's name: set_backend compares it
        self._fast = int4_native_available()

    def set_native(self, on: bool) -> None:
        self.native = on  # the kernel reads self.quantized.packed at each call: nothing to bind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        y = int4_linear(x2, self.quantized) if self._fast else int4_linear_ref(x2, self.quantized)
        y = y.view(*lead, y.shape[-1])
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.quantized.packed]

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        (self.quantized.packed,) = tensors

    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        if not self._fast:
            return None
        return int4_graph_call(self.quantized, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), rows,
                               threads)  # fmt: skip
