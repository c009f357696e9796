"""Linear layers over recap's native kernels: fp32 weights (csrc/linear_rows.c) and int8 weights (csrc/linear_int8.c),
each at any row count (decode and prefill).

At 1-8 rows a linear layer is bound by reading its weight, which oneDNN, MKL and torch.compile's mat-vec do at
well below the memory's rate, and at 8 rows oneDNN reads it at about half that rate (docs/performance.md).
- One fp32 row (`linear_rows_f32`, bound per layer by `RowKernel`): each thread streams its share of the
  weight rows (row-major).
- fp32, any row count (`linear_panels_f32`): the weight as 32-column panels (`pack_panels`). One row: a 1 x 32
  column product per k, bound by reading the panel (as fast as the one-row kernel on the row-major weight).
  Several: an 8-row x 32-column outer product per k, every group of 8 rows of a 64-row block run over a panel
  while it sits in L2 (the weight read once per 64 rows). The one layout of a dense fp32 layer served with the
  native kernels (model/layers/linear.py has the measurements).
- int8 (`linear_rows_int8`, any number of rows): the weight in `pack_int8`'s tiles of 8 rows, the one copy an
  int8 layer keeps (with its row sums and scales). One row streams the tiles (decode); two rows and more run
  a GEMM over the same tiles (batched decode and prefill: a block of quantized rows in L2, a tile's k-block
  in L1, 3 rows x 8 outputs per weight load), at or ahead of fbgemm's rate on its own packed copy
  (docs/performance.md), so neither fbgemm's copy nor the int8 matrix itself need be kept beside the tiles.
`linear_rows_f32` and `linear_panels_f32` agree with F.linear to fp32 rounding (other summation orders);
`linear_rows_int8` computes exactly the integer product of `quant.int8_linear_ref` and the same
dequantization, so it equals that reference bit for bit at every row count (and a row's result does not
depend on the rows batched with it).

References: `linear_rows_f32_ref` (F.linear) and `quant.int8_linear_ref`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recap.kernels.native import NativeUnavailableError, load_library, raw_function

# The one-row fp32 kernel's rows (more fp32 rows: the panels).
MAX_ROWS = 1

logger = logging.getLogger(__name__)

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The fp32 library with its signatures set (extra_flags: native.load_library's, for the paths of other
    instruction sets); raises NativeUnavailableError."""
    lib = load_library("linear_rows", extra_flags)
    lib.recap_linear_f32.argtypes = [_P, _I64, _P, _I64, _I64, _P, _P, _INT]
    lib.recap_linear_f32.restype = None
    lib.recap_linear_f32_panels.argtypes = [_P, _I64, _P, _I64, _I64, _P, _P, _INT]
    lib.recap_linear_f32_panels.restype = _INT
    return lib


@functools.cache
def int8_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The int8 library with its signatures set (extra_flags: native.load_library's, for the paths of other
    instruction sets); raises NativeUnavailableError."""
    lib = load_library("linear_int8", extra_flags)
    lib.recap_linear_i8.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _F32, _INT, _INT, _INT]
    lib.recap_linear_i8.restype = _INT
    return lib


@functools.cache
def linear_rows_available() -> bool:
    """Whether the kernels build and load here (builds them on the first call: about a second); says why not
    once, as a warning."""
    try:
        _lib()
        int8_library()
    except NativeUnavailableError as e:
        logger.warning("native decode kernels unavailable, linear layers keep torch's: %s", e)
        return False
    return True


def use_linear_rows(x: torch.Tensor) -> bool:
    """Whether a linear layer's input is few-row enough for these kernels."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_rows_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] fp32 (n small), weight [out, in] fp32 contiguous, bias [out] or None -> [n, out]."""
    x = x.contiguous()
    n, k = x.shape
    out = weight.shape[0]
    y = torch.empty(n, out, dtype=torch.float32, device="cpu")
    _lib().recap_linear_f32(x.data_ptr(), n, weight.data_ptr(), out, k, _ptr(bias), y.data_ptr(),
                            torch.get_num_threads())
    return y


def linear_rows_f32_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain reference of linear_rows_f32."""
    return F.linear(x, weight, bias)


PANEL = 32  # csrc/linear_rows.c's fp32 panels: 32 output columns (any number of input rows)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 as the few-row kernel's panels [ceil(out/32), in, 32] (zero columns pad the last):
    one sequential stream per 32 output columns. Written in place: no other copy of the weight on the way."""
    out, k = weight.shape
    full, rest = divmod(out, PANEL)
    panels = torch.empty(full + (rest > 0), k, PANEL, dtype=weight.dtype, device="cpu")
    w = weight.detach()
    panels[:full].copy_(w[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if rest:
        panels[full].zero_()
        panels[full, :, :rest].copy_(w[full * PANEL :].T)
    return panels


def unpack_panels(panels: torch.Tensor, out: int) -> torch.Tensor:
    """The weight [out, in] that pack_panels packed into `panels`, exactly (a permutation of its values)."""
    p, k, width = panels.shape
    return panels.transpose(1, 2).reshape(p * width, k)[:out].contiguous()


def linear_panels_f32(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out: int,
                      library: ctypes.CDLL | None = None) -> torch.Tensor:  # fmt: skip
    """x [n, in] fp32 (n >= 1) times the weight [out, in] packed by pack_panels -> [n, out]; agrees with F.linear
    to fp32 rounding (another summation order). Batched decode: at 8 rows about 1.8x oneDNN's rate. `library`:
    another build of the fp32 library (tests), else this CPU's."""
    x = x.contiguous()
    n, k = x.shape
    if n < 1 or panels.shape[1:] != (k, PANEL) or panels.shape[0] * PANEL < out:
        raise ValueError(f"panels {tuple(panels.shape)} do not fit x {tuple(x.shape)} and {out} outputs")
    y = torch.empty(n, out, dtype=torch.float32, device="cpu")
    lib = _lib() if library is None else library
    if lib.recap_linear_f32_panels(x.data_ptr(), n, panels.data_ptr(), out, k, _ptr(bias), y.data_ptr(),
                                   torch.get_num_threads()):  # fmt: skip
        raise MemoryError(f"linear_panels_f32: no memory for a {k} x {n} scratch buffer")
    return y


def panels_graph_call(
    x: ctypes.c_void_p, y: ctypes.c_void_p, rows: int, panels: torch.Tensor, bias: torch.Tensor | None, out: int,
    threads: ctypes.c_int,
) -> tuple[ctypes._CFuncPtr, tuple, str]:
    """linear_panels_f32 on `rows` rows at address x [rows, in] into y [rows, out], as a decode graph replays it:
    (function, arguments, what a nonzero return means)."""
    if rows < 1 or panels.dtype != torch.float32 or not panels.is_contiguous():
        raise ValueError(f"panels_graph_call: {rows} rows or panels {tuple(panels.shape)} do not fit the kernel")
    args = (x, _I64(rows), _P(panels.data_ptr()), _I64(out), _I64(panels.shape[1]), _P(_ptr(bias)), y, threads)
    return raw_function(_lib(), "recap_linear_f32_panels", _INT), args, "linear_panels_f32: no memory for its scratch"


PACK_ROWS, CHUNK = 8, 64  # csrc/linear_int8.c's tile: 8 output rows x 64-byte chunks
MAX_INT8_IN = 65536  # csrc/linear_int8.c's MAX_K: its int32 sums stay exact up to here


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8 in the kernel's tiles: [out/8, in/64, 8, 64] (zero-padded), one sequential stream per
    tile of 8 rows. Read in place, the row-major weight streamed at half the rate of fp32 (8 short streams)."""
    out, k = q.shape
    outp, kp = -(-out // PACK_ROWS) * PACK_ROWS, -(-k // CHUNK) * CHUNK
    padded = q if (outp, kp) == (out, k) else F.pad(q, (0, kp - k, 0, outp - out))  # no copy where none is padded
    return padded.view(outp // PACK_ROWS, PACK_ROWS, kp // CHUNK, CHUNK).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True)
class Int8Rows:
    """Int8 rows with one fp32 scale each, read a few at a time (an embedding's lookups): a plain [vocab, d] table
    (group 1, chunk d) or a tied head's tiles [ceil(vocab/8), ceil(d/64), 8, 64] (pack_int8: group 8, chunk 64),
    whose rows are the table's (quant.quantize_int8_tiles) so that a tied model holds the matrix once."""

    q: torch.Tensor
    scales: torch.Tensor  # [vocab] fp32
    d: int
    group: int
    chunk: int

    @classmethod
    def table(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Rows:
        return cls(q, scales, q.shape[1], 1, q.shape[1])

    @classmethod
    def tiled(cls, tiles: torch.Tensor, scales: torch.Tensor, d: int) -> Int8Rows:
        return cls(tiles, scales, d, PACK_ROWS, CHUNK)

    @property
    def vocab(self) -> int:
        return self.scales.numel()

    def lookup_ref(self, ids: torch.Tensor) -> torch.Tensor:
        """q[ids] * scales[ids] in fp32 [n, d] (the reference of decode_ops.embed_rows_int8)."""
        s = self.scales.index_select(0, ids)[:, None]
        if self.group == 1:
            return self.q.index_select(0, ids).float() * s
        rows = self.q[torch.div(ids, self.group, rounding_mode="floor"), :, ids % self.group, :]
        return rows.reshape(ids.numel(), -1)[:, : self.d].float() * s


@functools.cache
def activation_grid(reduce_range: bool) -> tuple[float, int, int]:
    """(scale, zero point, qmax) of fbgemm's uint8 grid for the range [-1, 1] that every row is divided into
    (recap/model/quant.py): 7 bits when reduce_range."""
    qmax = 127 if reduce_range else 255
    scale = float(torch.tensor(2.0 / qmax, dtype=torch.float32))  # fbgemm keeps the scale in fp32
    return scale, round(1.0 / scale), qmax


def linear_rows_int8(x: torch.Tensor, packed: torch.Tensor, row_sums: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, reduce_range: bool, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [n, in] (any n) times an int8 weight q [out, in] -> [n, out] fp32, equal to quant.int8_linear_ref:
    packed = pack_int8(q), row_sums [out] int32 = q.sum(1), scales [out] fp32 (the weight's per-channel
    scales), bias [out] fp32 or None. `library`: another build of int8_library (tests), else this CPU's."""
    x = x.float().contiguous()
    n, k = x.shape
    out = row_sums.shape[0]
    if packed.shape[2:] != (PACK_ROWS, CHUNK) or packed.shape[1] * CHUNK < k or packed.shape[0] * PACK_ROWS < out:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} and {out} outputs")
    if k > MAX_INT8_IN:
        raise ValueError(f"int8 weights take at most {MAX_INT8_IN} input features, not {k}")
    qscale, zp, qmax = activation_grid(reduce_range)
    y = torch.empty(n, out, dtype=torch.float32, device="cpu")
    lib = int8_library() if library is None else library
    rc = lib.recap_linear_i8(x.data_ptr(), n, packed.data_ptr(), row_sums.data_ptr(), scales.data_ptr(), out, k,
                             _ptr(bias), y.data_ptr(), qscale, zp, qmax, torch.get_num_threads())
    if rc != 0:
        raise int8_error(rc, n, k)
    return y


def int8_error(rc: int, n: int, k: int) -> Exception:
    """recap_linear_i8's nonzero return code as an exception (-2, a width past MAX_K, is checked before)."""
    return MemoryError(f"linear_rows_int8: no memory for a {n} x {k} scratch buffer (code {rc})")


class RowKernel:
    """One linear layer's weight bound to its native kernel, the addresses and sizes taken once (a decode step
    calls ~50-130 linears; the per-call argument handling of linear_rows_f32 / _int8 cost a few us each).
    Call it with contiguous fp32 rows x [n, in] -> [n, out]: one row for an fp32 weight, any number for an
    int8 one. Build it again when the weight moves."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None) -> None:
        """fp32: weight [out, in] contiguous; int8: weight None and int8 = (packed, row_sums, scales,
        reduce_range) as linear_rows_int8 takes them."""
        if int8 is None:
            lib = _lib()
            assert weight is not None and weight.dtype == torch.float32 and weight.is_contiguous()
            self.out, self.k = weight.shape
            self._keep: list[torch.Tensor] = [weight.detach()] + ([] if bias is None else [bias.detach()])
            self._fn = lib.recap_linear_f32
            self._pre = (weight.data_ptr(), self.out, self.k, _ptr(bias))
            self._post: tuple = ()
        else:
            packed, row_sums, scales, reduce_range = int8
            self.out, self.k = row_sums.shape[0], packed.shape[1] * CHUNK
            if self.k > MAX_INT8_IN:
                raise ValueError(f"int8 weights take at most {MAX_INT8_IN} input features, not {self.k}")
            self._keep = [packed, row_sums, scales] + ([] if bias is None else [bias.detach()])
            self._fn = int8_library().recap_linear_i8
            self._int8 = (packed.data_ptr(), row_sums.data_ptr(), scales.data_ptr())
            self._post = activation_grid(reduce_range)
            self._bias = _ptr(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape
        if k > self.k or (not self._post and k != self.k):  # int8: self.k is the padded width
            raise ValueError(f"{k} input features for a weight of {self.k}")
        y = torch.empty(n, self.out, device="cpu")
        if self._post:
            rc = self._fn(x.data_ptr(), n, *self._int8, self.out, k, self._bias, y.data_ptr(), *self._post,
                          torch.get_num_threads())  # fmt: skip
            if rc:
                raise int8_error(rc, n, k)
        else:
            assert n == 1, "the fp32 one-row kernel takes one row (several: linear_panels_f32)"
            self._fn(x.data_ptr(), 1, *self._pre, y.data_ptr(), torch.get_num_threads())
        return y

    def graph_call(self, x: ctypes.c_void_p, y: ctypes.c_void_p, in_features: int, threads: ctypes.c_int,
                   rows: int = 1) -> tuple[ctypes._CFuncPtr, tuple, str | None]:
        """The call of this kernel on `rows` rows at address x [rows, in_features] into y [rows, out], as a
        decode graph replays it: (function, arguments, what a nonzero return means or None). Several rows:
        int8 weights only (fp32 weights take the panel kernel)."""
        if self._post:
            qscale, zp, qmax = self._post
            args = (x, _I64(rows), *(_P(a) for a in self._int8), _I64(self.out), _I64(in_features), _P(self._bias),
                    y, _F32(qscale), _INT(zp), _INT(qmax), threads)  # fmt: skip
            fn = raw_function(int8_library(), "recap_linear_i8", _INT)
            return fn, args, "linear_rows_int8: no memory for its scratch"
        if rows != 1:
            raise ValueError("the fp32 one-row kernel takes one row (several: linear_panels_f32)")
        w, out, k, b = self._pre
        args = (x, _I64(1), _P(w), _I64(out), _I64(k), _P(b), y, threads)
        return raw_function(_lib(), "recap_linear_f32"), args, None
