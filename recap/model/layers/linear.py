"""Linear layer: a plain reference path (`F.linear`) and an optional oneDNN path on a packed weight.

Why oneDNN: on this class of CPU the default (MKL) sgemm is pathological for 2..64 rows (batched
decode) and slow for a single row with the [out, in] layout; oneDNN's linear over a weight packed once
was the fastest option measured for 1, 8 and 2048 rows (benchmarks/bench_model.py).
The packing is chosen for PACK_ROWS-row inputs (`mkldnn._reorder_linear_weight`): measured on a 2-core
Zen 3, one thread, against the generic `to_mkldnn()` packing: 8 rows 0.82 vs 1.17 ms (768 -> 3352) and
11.7 vs 18.0 ms (768 -> 50280), 2048 rows ~10% faster, 1 row within noise.
Both paths compute the same product; they agree to fp32 rounding, not bitwise.
A bf16 weight is packed the same way (oneDNN's bf16 kernels): at 1 and 8 rows it reads half the bytes and
ran ~2x faster than fp32 (AVX-512 EPYC, 768 -> 32000: 4.2 vs 10.3 ms at 1 row); plain F.linear in bf16
was no faster than fp32.
The "int8" backend quantizes the weight (recap/model/quant.py: per-channel int8, fbgemm's dynamic linear), the
"int4" one to group-wise 4-bit codes (recap/kernels/linear_int4.py: native kernels at every row count).
A Linear holds one implementation object (`impl`: DenseLinear for "torch" and "onednn", Int8Linear for "int8",
Int4Linear for "int4"),
which also routes few-row inputs to the native kernels when they are on; a backend reaches its packed copies
and native calls only through LinearImpl's public methods.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.linear_int4 import (
    Int4Weight,
    int4_graph_call,
    int4_linear,
    int4_linear_ref,
    int4_native_available,
    quantize_int4,
)
from recap.kernels.linear_rows import RowKernel, linear_panels_f32, pack_int8, pack_panels, panels_graph_call
from recap.model.capture import DecodeCapture, GraphUnsupportedError, NativeCall
from recap.model.quant import Int8Weight, int8_linear, quantize_int8

LINEAR_BACKENDS = ("torch", "onednn", "int8", "int4")
PACK_ROWS = 8  # the batch size oneDNN is told to expect when it packs a weight (batched decode)
# Inputs of 2..PANEL_ROWS rows take the native panel kernel when it is on: from memory it led oneDNN up to 32
# rows (16: 91-93 vs 75-81 GF/s at 1 thread, 32: 97-100 vs 90-93) and tied it at 48-64 (docs/performance.md).
PANEL_ROWS = 32
# Inputs of 2..INT8_ROWS rows with int8 weights take the native int8 kernel when it is on: faster than fbgemm
# there (1.2-1.8x over a decode step's shapes at 1-2 threads, weights from memory), bit-equal to
# quant.int8_linear_ref, so a row's result does not depend on the rows beside it, and the decode graph
# replays the same calls. At 16 rows fbgemm led (0.84-0.88x).
INT8_ROWS = 8
# Int4Linear's format (benchmarks/bench_int4.py, docs/performance.md): symmetric codes in groups of 32 inputs.
INT4_GROUP, INT4_ASYM = 32, False


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A weight to be filled by the loader (inference only: no grad)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN copy of weight [out, in] laid out for PACK_ROWS-row inputs (generic layout if unavailable)."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is not None and weight.dtype in (torch.float32, torch.bfloat16):
        return reorder(weight, PACK_ROWS)
    return weight.to_mkldnn()


class LinearImpl(ABC):
    """How one Linear computes y = x W^T + b, with the copies of the weight that way needs (Linear.impl).

    The weight and bias are the layer's parameters (the same objects: a backend that moves them with
    `param.data = ...` calls `rebind` afterwards). `tensors()` are the plain copies this implementation made
    for its native kernels (panels, int8 tiles), which a backend may move too (onto huge pages) and hand back
    through `rebind`; `graph_call` is one native call of this layer as a decode graph replays it.
    """

    name: str  # the linear backend it implements: one of LINEAR_BACKENDS

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        self.weight, self.bias = weight, bias
        self.native = False  # few-row inputs take recap's native kernels (kernels/linear_rows.py); set_native

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def set_native(self, on: bool) -> None:
        """Route few-row fp32 inputs to the native kernels (bound to the weight's address: call again when it
        moves); their packed copies are made once and kept while off."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The plain contiguous copies of the weight this implementation made (none: [])."""

    def rebind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Take `tensors` (same shapes and values as `tensors()`, new storage) in their place, and bind the native
        kernels again (to them and to the parameters, which may have moved too)."""
        old = self.tensors()
        fits = len(old) == len(tensors) and all(
            a.shape == b.shape and a.dtype == b.dtype and b.is_contiguous() for a, b in zip(old, tensors)
        )
        if not fits:
            raise ValueError("rebind takes contiguous tensors of the shapes and dtypes of tensors()")
        self._replace(list(tensors))
        self.set_native(self.native)

    @abstractmethod
    def _replace(self, tensors: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        """The native call computing y [rows, out] from x [rows, in] (fixed buffers) as a decode graph replays
        it, or None where no native kernel is bound for `rows` rows."""


class DenseLinear(LinearImpl):
    """fp32 or bf16 weights: F.linear ("torch"), or oneDNN over a copy packed for PACK_ROWS rows ("onednn").
    With the native kernels on, one fp32 row takes the one-row kernel and 2..PANEL_ROWS fp32 rows the panel
    kernel (over a third copy of the weight, beside the weight and oneDNN's copy for prefill)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, onednn: bool) -> None:
        super().__init__(weight, bias)
        use = onednn and onednn_available() and weight.device.type == "cpu"
        self._packed = _pack(weight.detach()) if use else None  # oneDNN's copy of the weight
        self.name = "onednn" if self._packed is not None else "torch"
        self._rows: RowKernel | None = None  # the one-row kernel bound to this weight
        self._panels: torch.Tensor | None = None  # the fp32 weight in the few-row kernel's panels

    def set_native(self, on: bool) -> None:
        self.native = on
        w = self.weight
        if on and w.dtype == torch.float32 and w.device.type == "cpu" and self._panels is None:
            self._panels = pack_panels(w)
        self._rows = RowKernel(w, self.bias) if on and w.dtype == torch.float32 and w.is_contiguous() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.shape[0] == 1:
            return rows(x)  # the native kernel (batch-1 decode)
        panels = self._panels
        if (panels is not None and self.native and x.dim() == 2 and 1 < x.shape[0] <= PANEL_ROWS
                and x.dtype == torch.float32):  # fmt: skip
            return linear_panels_f32(x, panels, self.bias, self.weight.shape[0])  # batched decode
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._panels is None else [self._panels]

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            (self._panels,) = tensors

    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        if self._rows is not None and rows == 1:
            return self._rows.graph_call(_addr(x), _addr(y), x.shape[1], threads, 1)
        if rows > 1 and self.native and self._panels is not None:
            return panels_graph_call(_addr(x), _addr(y), rows, self._panels, self.bias, self.weight.shape[0], threads)
        return None


class Int8Linear(LinearImpl):
    """Per-channel int8 weights (model/quant.py, fbgemm's dynamic linear); with the native kernels on, inputs of
    1..INT8_ROWS fp32 rows take the native int8 kernel over the weight in its tiles."""

    name = "int8"

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__(weight, bias)
        self.quantized: Int8Weight = quantize_int8(weight, bias)  # QuantizationUnavailableError without fbgemm
        self._rows: RowKernel | None = None  # the native kernel bound to the tiles
        self._tiles: torch.Tensor | None = None  # the int8 weight in the native kernel's tiles

    def set_native(self, on: bool) -> None:
        self.native = on
        if on and self._tiles is None:
            self._tiles = pack_int8(self.quantized.qweight)
        w = self.quantized
        self._rows = RowKernel(None, w.bias, (self._tiles, w.row_sums, w.scales, w.reduce_range)) if on else None  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if (rows is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
                and x.shape[0] <= INT8_ROWS):  # fmt: skip
            return rows(x)  # the native kernel (batch-1 and batched decode)
        y = int8_linear(x, self.quantized)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._tiles is None else [self._tiles]

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            (self._tiles,) = tensors

    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        if self._rows is None or rows > INT8_ROWS:
            return None
        return self._rows.graph_call(_addr(x), _addr(y), x.shape[1], threads, rows)


class Int4Linear(LinearImpl):
    """Group-wise 4-bit weights (kernels/linear_int4.py): the native kernel at every row count where it builds,
    its torch reference elsewhere (equal results). Only the packed form is kept: the parameters are not read
    after construction."""

    name = "int4"

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__(weight, bias)
        self.quantized: Int4Weight = quantize_int4(weight, INT4_GROUP, INT4_ASYM, bias)
        self._fast = int4_native_available()

    def set_native(self, on: bool) -> None:
        self.native = on  # the int4 kernel is this backend's kernel: it runs with the flag on or off

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
        return int4_graph_call(self.quantized, _addr(x), _addr(y), rows, threads) if self._fast else None


def _addr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class Linear(nn.Module):
    """y = x W^T + b, weight [out, in] as stored on disk; computed by one implementation object (`impl`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.impl: LinearImpl = DenseLinear(self.weight, self.bias, onednn=False)

    @property
    def backend(self) -> str:
        return self.impl.name

    def set_backend(self, backend: str) -> None:
        """ "torch" (reference), "onednn", "int8" or "int4": the last three pack a copy of the weight (call again
        after reloading weights). "int8" raises QuantizationUnavailableError on a torch without fbgemm. The native
        kernels stay on or off."""
        if backend not in LINEAR_BACKENDS:
            raise ValueError(f"unknown linear backend {backend!r}; choose one of {LINEAR_BACKENDS}")
        native = self.impl.native
        if backend == "int8":
            self.impl = Int8Linear(self.weight, self.bias)
        elif backend == "int4":
            self.impl = Int4Linear(self.weight, self.bias)
        else:
            self.impl = DenseLinear(self.weight, self.bias, onednn=backend == "onednn")
        self.impl.set_native(native)  # the native kernel follows the new weight format

    def set_native(self, on: bool) -> None:
        """Send one-row fp32 inputs (batch-1 decode) with fp32 or int8 weights to the native kernels of
        kernels/linear_rows.py, inputs of 2..INT8_ROWS rows with int8 weights to its int8 kernel, and inputs of
        2..PANEL_ROWS rows with fp32 weights to its panel kernel; the caller checks `linear_rows_available()`
        first. Other inputs, and bf16 weights, keep the backend. Call again when the weight moves."""
        self.impl.set_native(on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x)

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
        """Record this layer on x [rows, in] through its native kernel -> y [rows, out] (model/capture.py)."""
        if type(self) is not Linear or x.shape[1] != self.in_features:
            raise GraphUnsupportedError(f"linear layer {type(self).__name__}")
        y = builder.buffer(self.out_features)
        call = self.impl.graph_call(x, y, builder.rows, builder.threads)
        if call is None:
            raise GraphUnsupportedError(f"a linear layer without a native kernel for {builder.rows} rows")
        builder.record(call)
        return y


def tied_linear(weight: nn.Parameter) -> Linear:
    """A bias-free Linear over an existing weight (a tied lm_head); shares the tensor, copies nothing."""
    head = Linear.__new__(Linear)
    nn.Module.__init__(head)
    head.in_features, head.out_features = weight.shape[1], weight.shape[0]
    head.weight = weight
    head.bias = None
    head.impl = DenseLinear(weight, None, onednn=False)
    return head
