"""Linear layer: a plain reference path (`F.linear`) and the serving paths, each keeping ONE copy of the weight.

A Linear holds one implementation object (`impl`: DenseLinear for "torch" and "onednn", Int8Linear for "int8",
layers/int4_linear.py's Int4Linear for "int4": group-wise 4-bit weights, recap/kernels/linear_int4.py).
An implementation that holds the weight in its own layout (`LinearImpl.owns_weight`: oneDNN's packed copy, the
native panels, int8 tiles) never reads the parameter, and the Linear then releases it (`Linear.release_weight`):
the weight stops being a parameter, `in_features` / `out_features` keep the shape, and whatever asks for it
later (`.weight`, `state_dict()`, `set_backend` to a dense backend of a quantized layer) gets a
WeightReleasedError. A dense layout gives the weight back exactly (`LinearImpl.dense_weight`), so switching
between dense backends works; a quantized one cannot. A tied head (the embedding's table) and a weight its
owner reads itself (`reads_weight`: Mamba1's dt_proj, MLA's kv_b_proj) are never released.

The one layout of a dense layer, chosen by measurement (benchmarks/bench_linear_layouts.py, 1 thread, AVX-512
EPYC, medians of 5 alternating runs, ms; weights cycled from memory; docs/performance.md has the full table):

| fp32, in -> out | rows | panels | one-row kernel | oneDNN packed | F.linear |
|---|---:|---:|---:|---:|---:|
| 2048 -> 2048 | 1 / 8 / 32 | 0.50 / 0.88 / 1.44 | 0.48 | 0.78 / 1.23 / 1.57 | 0.82 / 2.54 / 6.47 |
| 2048 -> 2048 | 512 / 2048 | 36.4 / 118 | - | 30.6 / 106 | 82 / 259 |
| 2048 -> 8192 | 1 / 8 / 32 | 2.38 / 2.86 / 5.84 | 2.35 | 2.53 / 3.79 / 10.2 | 4.55 / 9.58 / 16.0 |
| 2048 -> 8192 | 512 | 101 | - | 107 | 266 |
| 8192 -> 2048 | 32 / 512 / 2048 | 5.78 / 83.1 / 335 | - | 6.31 / 72.9 / 288 | 14.3 / 167 / 660 |
| 2048 -> 49152 | 1 / 8 / 32 / 512 | 10.3 / 14.0 / 34.0 / 537 | 10.5 | 10.5 / 16.1 / 35.6 / 474 | 18 / 54 / 105 / 1153 |

- fp32 with the native kernels on ("onednn" on the CPU backend): the panels (kernels/linear_rows.py) for every
  row count. They lead oneDNN at 1-32 rows (1.02-1.75x) and match the one-row kernel at one row; at 512-2048 rows
  oneDNN's GEMM is 12-19% faster (2048 -> 8192 at 2048 rows: 571 vs 486 ms; at 512 rows the panels led, 101 vs
  107). Keeping oneDNN's copy for prefill would cost a second fp32 model of memory for that: not kept (end to
  end, a 1024-token prefill of a d_model-768 Mamba2 tied: 1223 ms on the panels, 1247 on oneDNN's copy).
- fp32 with the native kernels off, and bf16 ("onednn"): oneDNN's copy packed for PACK_ROWS rows, every row
  count. bf16: oneDNN's packed copy led or tied F.linear at every shape and row count (1 row: 2.2x on the 49152
  head, 8 rows 1.4x, 2048 rows 1.0-1.25x), so it is the only copy.
- "torch" (the reference, and the only path off the CPU): the parameter through F.linear; with the native
  kernels on, 1..PANEL_ROWS fp32 rows take the panels, a second copy (the reference keeps its parameter).
oneDNN's packing for PACK_ROWS-row inputs (`mkldnn._reorder_linear_weight`) was measured on a 2-core Zen 3 against
the generic `to_mkldnn()`: 8 rows 0.82 vs 1.17 ms (768 -> 3352), 2048 rows ~10% faster, 1 row within noise.
The paths compute the same product; they agree to fp32 rounding, not bitwise.
The "int8" backend quantizes the weight (recap/model/quant.py: per-channel int8): where the native kernels
build, kept only in the native int8 kernel's tiles, which take every row count (Int8Linear); elsewhere fbgemm's
dynamic linear on its packed copy.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.linear_rows import (
    RowKernel,
    linear_panels_f32,
    linear_rows_available,
    pack_panels,
    panels_graph_call,
    unpack_panels,
)
from recap.kernels.native import address as _addr
from recap.model.capture import DecodeCapture, GraphUnsupportedError, NativeCall
from recap.model.quant import Int8Tiles, Int8Weight, int8_linear, quantize_int8, quantize_int8_tiles

LINEAR_BACKENDS = ("torch", "onednn", "int8", "int4", "int4_k")  # int4_k: int4 in super-blocks
PACK_ROWS = 8  # the batch size oneDNN is told to expect when it packs a weight (batched decode)
# The reference ("torch") with the native kernels on: inputs of 1..PANEL_ROWS fp32 rows take the panel kernel
# (from memory it led oneDNN up to 32 rows: 16: 91-93 vs 75-81 GF/s at 1 thread, 32: 97-100 vs 90-93).
PANEL_ROWS = 32


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A weight to be filled by the loader (inference only: no grad)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's packed linear runs here for `dtype` (an AVX2-only CPU packs no bf16 weight: F.linear)."""
    ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return ok and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class WeightReleasedError(RuntimeError):
    """A linear layer's full-precision weight was released (its implementation holds the only copy) and something
    asked for it: the parameter, a state dict, or a dense backend of a quantized layer. Load the model again."""


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
    An implementation that `owns_weight` computes from its own copies only: the Linear releases the parameter
    once it is built (then `weight` is None here) and asks `dense_weight` should it need the weight again.
    """

    name: str  # the linear backend it implements: one of LINEAR_BACKENDS
    owns_weight: bool = False  # never reads the weight parameter (its own layout holds the values)

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        self.weight: nn.Parameter | None = weight
        self.bias = bias
        self.native = False  # few-row inputs take recap's native kernels (kernels/linear_rows.py); set_native

    def dense_weight(self) -> torch.Tensor:
        """The full weight [out, in] in the layer's dtype: the parameter, or rebuilt exactly from this
        implementation's own layout; WeightReleasedError where that is lossy (a quantized weight)."""
        if self.weight is None:
            raise WeightReleasedError(f"the {self.name} layer's full-precision weight was released")
        return self.weight.detach()

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
    """fp32 or bf16 weights in one layout (the module docstring has the measurements):
    - "onednn", fp32 with the native kernels on: the native panels, every row count;
    - "onednn" otherwise (native off, or bf16): oneDNN's copy packed for PACK_ROWS rows, every row count;
    - "torch": the parameter through F.linear; with the native kernels on, 1..PANEL_ROWS fp32 rows take the
      panels (a second copy, kept while off: the reference keeps its parameter).
    "onednn" owns its weight; switching the native kernels re-lays it out one layer at a time (exactly)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, onednn: bool, native: bool = False) -> None:
        super().__init__(weight, bias)
        self.out, self.dtype = weight.shape[0], weight.dtype
        self._cpu = weight.device.type == "cpu"
        self.owns_weight = onednn and onednn_available(weight.dtype) and self._cpu
        self.name = "onednn" if self.owns_weight else "torch"
        self._packed: torch.Tensor | None = None  # oneDNN's copy of the weight
        self._panels: torch.Tensor | None = None  # the fp32 weight in the native kernel's panels
        self.set_native(native)

    def set_native(self, on: bool) -> None:
        self.native = on
        panels = on and self.dtype == torch.float32 and self._cpu
        if panels and self._panels is None:
            self._panels = pack_panels(self.dense_weight())
        if self.owns_weight:  # exactly one layout: the new one made (from the old), then the old dropped
            if not panels and self._packed is None:
                self._packed = _pack(self.dense_weight())
            self._panels, self._packed = (self._panels, None) if panels else (None, self._packed)

    def dense_weight(self) -> torch.Tensor:
        if self.weight is not None:
            return self.weight.detach()
        if self._panels is not None:
            return unpack_panels(self._panels, self.out)
        assert self._packed is not None, "an owning dense layer holds one of its layouts"
        return self._packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        panels = self._panels
        if panels is not None and self.native and x.dtype == torch.float32:
            rows = x.numel() // x.shape[-1]
            if self.owns_weight or rows <= PANEL_ROWS:
                if rows == 0:
                    return x.new_zeros(*x.shape[:-1], self.out)
                y = linear_panels_f32(x.reshape(rows, x.shape[-1]), panels, self.bias, self.out)
                return y.view(*x.shape[:-1], self.out)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        if self.weight is None:  # panels only, and an input they do not take (not fp32)
            return linear_panels_f32(x.reshape(-1, x.shape[-1]).float(), panels, self.bias, self.out).to(
                x.dtype).view(*x.shape[:-1], self.out)  # fmt: skip
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._panels is None else [self._panels]

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            (self._panels,) = tensors

    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        if self.native and self._panels is not None and (self.owns_weight or rows <= PANEL_ROWS):
            return panels_graph_call(_addr(x), _addr(y), rows, self._panels, self.bias, self.out, threads)
        return None


class Int8Linear(LinearImpl):
    """Per-channel int8 weights (model/quant.py).

    Where the native kernels build, the weight is kept once, in the native int8 kernel's tiles with its row
    sums and scales (`quant.Int8Tiles`), and every row count runs that kernel (kernels/linear_rows.py): 1 row
    streams the tiles, more rows run its GEMM over them, at or above fbgemm's rate (docs/performance.md), bit
    for bit `quant.int8_linear_ref` at any batch. No fbgemm copy and no int8 matrix beside the tiles: an int8
    layer holds its weight's int8 size once. `set_native` then only rebinds the kernel to the tiles (it is the
    layer's one implementation, on or off). Where they do not build, fbgemm's dynamic linear over its packed
    copy (`quant.int8_linear`). The constructor quantizes `weight`; nothing reads it afterwards (a loader may
    free the fp32 weight once the layers are quantized).
    """

    name = "int8"
    owns_weight = True  # the Linear frees the fp32 weight once quantized

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__(weight, bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # native: the tiles only; else fbgemm's (QuantizationUnavailableError without fbgemm)
        self.tiles: Int8Tiles | None = quantize_int8_tiles(weight, bias) if linear_rows_available() else None
        self.quantized: Int8Weight | None = None if self.tiles is not None else quantize_int8(weight, bias)
        self._rows: RowKernel | None = None  # the native kernel bound to the tiles
        self._bind()

    def _bind(self) -> None:
        t = self.tiles
        self._rows = None if t is None else RowKernel(None, t.bias, (t.tiles, t.row_sums, t.scales, t.reduce_range))

    def set_native(self, on: bool) -> None:
        self.native = on
        self._bind()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            y = int8_linear(x, self.quantized)  # type: ignore[arg-type]
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{x.shape[-1]} input features for an int8 weight of {self.in_features}")
        y = rows(x.reshape(-1, self.in_features).float().contiguous())
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.tiles is None else [self.tiles.tiles]

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            assert self.tiles is not None
            (self.tiles.tiles,) = tensors

    def graph_call(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: ctypes.c_int) -> NativeCall | None:
        if self._rows is None:
            return None
        return self._rows.graph_call(_addr(x), _addr(y), x.shape[1], threads, rows)


class Linear(nn.Module):
    """y = x W^T + b, weight [out, in] as stored on disk; computed by one implementation object (`impl`).

    reads_weight: the owning module reads `weight` itself (a kernel takes the matrix; `impl` is never called):
    it stays the plain parameter whatever the backend, with no other copy. A tied head (`tied_linear`) shares
    the embedding's table (`shares_weight`): kept while the head is dense (the embedding reads the table); once
    the head is quantized its reference is dropped, and the embedding holds the table (as int8 once quantized,
    layers/embedding.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 reads_weight: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.reads_weight, self.shares_weight = reads_weight, False
        self.released = False  # the weight parameter was freed: impl holds the only copy
        self.impl: LinearImpl = DenseLinear(self.weight, self.bias, onednn=False)

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        if name == "weight" and self.__dict__.get("released"):
            raise WeightReleasedError(f"the weight of this {self.impl.name} layer ({self.out_features} x "
                                      f"{self.in_features}) was released: its implementation holds the only copy")
        return super().__getattr__(name)

    @property
    def backend(self) -> str:
        return self.impl.name

    def set_backend(self, backend: str, native: bool | None = None, importance: torch.Tensor | None = None) -> None:
        """ "torch" (reference), "onednn", "int8", "int4" or "int4_k" (int4's super-block format), with the native
        kernels `native` (None: as they are); `importance` [in]: int4's fit weighs input channels by it.
        A layer already on `backend` keeps its implementation (a quantized layer is not quantized again); "onednn",
        "int8" and "int4" lay the weight out anew and release the parameter (release_weight). A released weight
        comes back from a dense layout for another dense backend; from int8 or int4 it cannot: WeightReleasedError.
        "int8" raises QuantizationUnavailableError where neither the native kernels build nor torch has fbgemm."""
        if backend not in LINEAR_BACKENDS:
            raise ValueError(f"unknown linear backend {backend!r}; choose one of {LINEAR_BACKENDS}")
        if importance is not None and backend not in ("int4", "int4_k"):
            raise ValueError(f"an importance row weighs the int4 fits, not backend {backend!r}")
        on = self.impl.native if native is None else native
        if self.reads_weight or backend == self.impl.name:
            self.set_native(on)
            return
        weight = self._dense_weight()
        if backend == "int8":
            self.impl = Int8Linear(weight, self.bias)
            self.impl.set_native(on)
        elif backend in ("int4", "int4_k"):
            from recap.model.layers.int4_linear import Int4Linear  # it imports this module (LinearImpl)

            self.impl = Int4Linear(weight, self.bias, superblock=backend == "int4_k", importance=importance)
            self.impl.set_native(on)
        else:
            self.impl = DenseLinear(weight, self.bias, onednn=backend == "onednn", native=on)
        self.release_weight()

    def adopt(self, impl: LinearImpl) -> None:
        """Run on `impl`, built from a checkpoint's own quantized form (model/prequantized_load.py): the weight
        parameter was never filled and is released."""
        self.impl = impl
        self.release_weight()

    def _dense_weight(self) -> nn.Parameter:
        """The weight parameter, registered again from the implementation's dense layout if it was released."""
        if self.released:
            weight = self.impl.dense_weight()  # WeightReleasedError from a quantized layout
            self.released = False
            self.weight = nn.Parameter(weight, requires_grad=False)
        return self.weight

    def release_weight(self) -> None:
        """Free the weight parameter where the implementation owns its own copy (not a directly read one, nor a
        shared one while dense): `weight` and `state_dict()` raise WeightReleasedError from then on."""
        dense_shared = self.shares_weight and self.impl.name not in ("int8", "int4", "int4_k")
        if self.released or self.reads_weight or not self.impl.owns_weight or dense_shared:
            return
        del self.weight  # off the module's parameters (not saved, not moved, not counted)
        self.impl.weight = None
        self.released = True

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if self.released:
            raise WeightReleasedError(f"{prefix}weight was released after {self.impl.name} laid it out; a state "
                                      "dict needs the full weight (load the model again)")  # fmt: skip
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def set_native(self, on: bool) -> None:
        """Send fp32 inputs to the native kernels of kernels/linear_rows.py: with fp32 weights on "onednn", every
        row count through the panels (the one layout); on "torch", 1..PANEL_ROWS rows. Int8 weights take the
        native int8 kernel at every row count whether on or off (where it builds: their one copy is its tiles).
        The caller checks `linear_rows_available()` first. bf16 weights keep the backend. Call again when the
        weight moves."""
        if self.reads_weight:  # its owner reads the parameter: no kernel, no copy
            self.impl.native = on
            return
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
    head.reads_weight, head.shares_weight, head.released = False, True, False  # the embedding reads the table
    head.impl = DenseLinear(weight, None, onednn=False)
    return head
