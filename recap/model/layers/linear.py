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
The "int8" backend quantizes the weight (recap/model/quant.py: per-channel int8, fbgemm's dynamic linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.linear_rows import RowKernel, linear_panels_f32, pack_int8, pack_panels
from recap.model.quant import Int8Weight, int8_linear, quantize_int8

LINEAR_BACKENDS = ("torch", "onednn", "int8")
PACK_ROWS = 8  # the batch size oneDNN is told to expect when it packs a weight (batched decode)
# Inputs of 2..PANEL_ROWS rows take the native panel kernel when it is on: from memory it led oneDNN up to 32
# rows (16: 91-93 vs 75-81 GF/s at 1 thread, 32: 97-100 vs 90-93) and tied it at 48-64 (docs/performance.md).
PANEL_ROWS = 32
# Inputs of 2..INT8_ROWS rows with int8 weights take the native int8 kernel when it is on: faster than fbgemm
# there (1.2-1.8x over a decode step's shapes at 1-2 threads, weights from memory), bit-equal to
# quant.int8_linear_ref, so a row's result does not depend on the rows beside it, and the decode graph
# replays the same calls. At 16 rows fbgemm led (0.84-0.88x).
INT8_ROWS = 8


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


class Linear(nn.Module):
    """y = x W^T + b, weight [out, in] as stored on disk."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN copy of the weight when that backend is on
        self._int8: Int8Weight | None = None  # int8 copy of the weight when that backend is on
        self._native = False  # one-row inputs take recap's native kernels (kernels/linear_rows.py)
        self._rows: RowKernel | None = None  # that kernel, bound to this weight (set_native)
        self._int8_rows: torch.Tensor | None = None  # the int8 weight in the native kernel's tiles
        self._panels: torch.Tensor | None = None  # the fp32 weight in the few-row native kernel's panels

    @property
    def backend(self) -> str:
        return "int8" if self._int8 is not None else "onednn" if self._packed is not None else "torch"

    def set_backend(self, backend: str) -> None:
        """ "torch" (reference), "onednn" or "int8": the last two pack a copy of the weight (call again after
        reloading weights). "int8" raises QuantizationUnavailableError on a torch without fbgemm."""
        if backend not in LINEAR_BACKENDS:
            raise ValueError(f"unknown linear backend {backend!r}; choose one of {LINEAR_BACKENDS}")
        self._int8 = quantize_int8(self.weight, self.bias) if backend == "int8" else None
        self._int8_rows = self._panels = None  # packed again by set_native for the new weight
        use = backend == "onednn" and onednn_available() and self.weight.device.type == "cpu"
        self._packed = _pack(self.weight.detach()) if use else None
        self.set_native(self._native)  # the native kernel follows the new weight format

    def set_native(self, on: bool) -> None:
        """Send one-row fp32 inputs (batch-1 decode) with fp32 or int8 weights to the native kernels of
        kernels/linear_rows.py, inputs of 2..8 rows with int8 weights to its int8 kernel, and inputs of 2..32
        rows with fp32 weights to its panel kernel (a third copy of
        the weight, beside the weight and oneDNN's copy for prefill); the caller checks
        `linear_rows_available()` first. Other inputs, and bf16 weights, keep the backend. Call again when the
        weight moves (it binds the kernel to its address); packed copies are made once and kept while off."""
        self._native = on
        if on and self._int8 is not None and self._int8_rows is None:
            self._int8_rows = pack_int8(self._int8.qweight)
        fp32 = self._int8 is None and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"
        if on and fp32 and self._panels is None:
            self._panels = pack_panels(self.weight)
        self._rows = None
        if on and self._int8 is not None and self._int8_rows is not None:
            w = self._int8
            self._rows = RowKernel(None, w.bias, (self._int8_rows, w.row_sums, w.scales, w.reduce_range))
        elif on and self.weight.dtype == torch.float32 and self.weight.is_contiguous():
            self._rows = RowKernel(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if (rows is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
                and (x.shape[0] == 1 or (rows.is_int8 and x.shape[0] <= INT8_ROWS))):  # fmt: skip
            return rows(x)  # the native kernel (batch-1 decode; batched decode with int8 weights)
        panels = self._panels
        if (panels is not None and self._native and x.dim() == 2 and 1 < x.shape[0] <= PANEL_ROWS
                and x.dtype == torch.float32):  # fmt: skip
            return linear_panels_f32(x, panels, self.bias, self.out_features)  # batched decode
        if self._int8 is not None:
            y = int8_linear(x, self._int8)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def tied_linear(weight: nn.Parameter) -> Linear:
    """A bias-free Linear over an existing weight (a tied lm_head); shares the tensor, copies nothing."""
    head = Linear.__new__(Linear)
    nn.Module.__init__(head)
    head.in_features, head.out_features = weight.shape[1], weight.shape[0]
    head.weight = weight
    head.bias = None
    head._packed = None
    head._int8 = None
    head._native = False
    head._rows = None
    head._int8_rows = None
    head._panels = None
    return head
