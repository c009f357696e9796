"""Int8 weights for the linear layers: per-output-channel symmetric int8, per-row 8-bit activations.

Two forms of one quantization (`quantize_int8_weight`):
- `Int8Tiles` (`quantize_int8_tiles`): the weight only in the native kernel's tiles (kernels/linear_rows.py,
  csrc/linear_int8.c), with its row sums and scales: 1 byte per weight and nothing else, every row count
  through the native kernel, bit-equal to `int8_linear_ref`. What an int8 layer keeps where the native
  kernels build (layers/linear.py): the int8 matrix and fbgemm's packed copy (below) are not kept, so an
  int8 layer holds its weight's int8 size once (it held three copies before: the matrix, fbgemm's, the tiles).
- `Int8Weight` (`quantize_int8`): the int8 matrix and fbgemm's packed copy, for `int8_linear`; the fallback
  where the native kernels do not build, and the form the reference takes.

`int8_linear` is fbgemm's dynamic-quantization linear (`torch.ops.quantized.linear_dynamic`,
the kernel behind torch.ao's dynamic quantization) on a weight packed once. It reads 1 byte per weight
instead of 4, multiplies u8 x s8 in int32 and returns fp32. SSM/conv states, norms, residuals and the
embedding stay in the model dtype (fp32 or bf16); only the matrices are int8.

Rows stay independent. fbgemm quantizes its whole input with one range (its min and max), so a row's
result would depend on the other rows of the step, and caching on/off (which changes what is batched
with what) would change outputs. So each row is first divided by its own max |x| (now within [-1, 1]),
and two constant columns, +1 and -1 (with zero weights), pin every call's range to exactly [-1, 1]: the
quantization grid is the same for every row whatever else is in the batch, and the row's scale is
multiplied back after the product. This is per-row (per-token) symmetric 8-bit activation quantization.

Why this path (measured on a 2-core AVX-512 EPYC, 1 thread, thread CPU time, 1 and 8 rows, 768 -> 3352
and 768 -> 32000 weights; docs/performance.md has the table):
- fbgemm dynamic int8: 4.5-6x faster than oneDNN fp32 (1.9 vs 8.6 ms for the 32000-row head at 1 row).
  Output error against the exact fp64 product ~1e-2 relative, most of it the weight rounding (0.8e-2).
- `torch.ops.aten._weight_int8pack_mm` (weight-only, fp32 activations): 3-27x *slower* than fp32 with fp32
  inputs (a scalar CPU path), and with bf16 inputs still 3x slower than fbgemm.
- `torch._int_mm` (s8 x s8 -> s32, oneDNN): 4x slower than fbgemm at 1-8 rows (6.3 vs 1.7 ms for the
  head), though faster at 2048 rows; dequantize-then-matmul: far slower.
llama.cpp's q8_0 matmul likewise quantizes activations to 8 bits (in blocks of 32 values).
Since then recap's native kernel over its tiles ran at or above fbgemm's rate at 1 to 2048 rows of 1B-model
shapes (benchmarks/bench_int8_gemm.py, docs/performance.md): fbgemm is the fallback where it does not build.

Saturation: without VNNI, fbgemm's AVX2 kernels add pairs of u8 x s8 products in int16 and can saturate;
torch.ao then restricts activations to 7 bits (`reduce_range`). With AVX-512 VNNI the products accumulate
in int32 directly, so the full 8 bits are used only where the CPU has VNNI.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from recap.kernels.linear_rows import CHUNK, PACK_ROWS, activation_grid, pack_int8
from recap.kernels.quant_chunks import chunk_rows

QUANTIZATIONS = ("int8", "int4", "int4_k")  # int4: recap/kernels/linear_int4.py; int4_k: its super-block format


class QuantizationUnavailableError(RuntimeError):
    """This torch build has no fbgemm int8 linear (the `quantized` ops or the fbgemm engine are missing)."""


@functools.cache
def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return False


def int8_activation_bits() -> int:
    """The activations' width of the int8 kernels here: 8 with VNNI, 7 without (fbgemm's grid; see above)."""
    return 8 if _cpu_has_vnni() else 7


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


@dataclass
class Int8Weight:
    """A weight [out, in] as int8 with one fp32 scale per output channel, and fbgemm's packed copy."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] fp32
    bias: torch.Tensor | None  # [out] fp32
    packed: torch.Tensor  # fbgemm's packed [out, in + 2] weight (two zero columns for the range pins)
    reduce_range: bool  # activations use 7 bits (CPUs without VNNI)
    row_sums: torch.Tensor  # [out] int32: sum of each row of qweight (the few-row kernel's zero-point term)


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scales [out] fp32), q = round(w / s),
    s = max|w_row| / 127 (a zero row gets s = 1). A chunk of rows at a time (quant_chunks), one fp32 copy of it
    the only temporary."""
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32)
    step = chunk_rows(max(w.shape[1], 1), 1)
    for lo in range(0, w.shape[0], step):
        rows = w[lo : lo + step].to(torch.float32, copy=True)
        s = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(127.0)  # no |rows| temporary
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[lo : lo + step] = rows.div_(s[:, None]).round_().clamp_(-127, 127)
        scales[lo : lo + step] = s
    return q, scales


def row_sums(q: torch.Tensor) -> torch.Tensor:
    """[out] int32: each row's sum of q [out, in] int8, a chunk of rows at a time (`q.sum(1, dtype=int32)` at
    once makes an int32 copy of the whole matrix: 600 MB beside a 1B model's 150 MB int8 head)."""
    out = torch.empty(q.shape[0], dtype=torch.int32)
    step = chunk_rows(max(q.shape[1], 1), 1)
    for lo in range(0, q.shape[0], step):
        out[lo : lo + step] = q[lo : lo + step].sum(1, dtype=torch.int32)
    return out


@dataclass
class Int8Tiles:
    """A weight [out, in] as int8 in the native kernel's tiles only (linear_rows.pack_int8), with what its
    epilogue needs: the int8 matrix itself is not kept."""

    tiles: torch.Tensor  # [ceil(out/8), ceil(in/64), 8, 64] int8
    row_sums: torch.Tensor  # [out] int32: sum of each row of q (the activations' zero-point term)
    scales: torch.Tensor  # [out] fp32
    bias: torch.Tensor | None  # [out] fp32
    reduce_range: bool  # activations use 7 bits (CPUs without VNNI; the same grid as fbgemm's there)
    in_features: int

    @property
    def out_features(self) -> int:
        return self.row_sums.shape[0]


def quantize_int8_tiles(weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None) -> Int8Tiles:
    """quantize_int8's quantization, kept only in the native kernel's tiles (no fbgemm needed): `rows` rows (a
    multiple of the tiles' 8; default quant_chunks') quantized and packed at a time straight into the tiles, so
    that no int8 matrix of the whole weight is made beside them (a 7B model's head: 0.5 GiB). Equal to pack_int8
    of quantize_int8_weight (the rows are independent)."""
    out, k = weight.shape
    chunk = chunk_rows(max(k, 1), PACK_ROWS) if rows is None else rows
    if chunk <= 0 or chunk % PACK_ROWS:
        raise ValueError(f"rows must be a positive multiple of {PACK_ROWS}, got {chunk}")
    tiles = torch.empty(-(-out // PACK_ROWS), -(-k // CHUNK), PACK_ROWS, CHUNK, dtype=torch.int8)
    sums = torch.empty(out, dtype=torch.int32)
    scales = torch.empty(out, dtype=torch.float32)
    for lo in range(0, out, chunk):
        q, s = quantize_int8_weight(weight[lo : lo + chunk])
        tiles[lo // PACK_ROWS : lo // PACK_ROWS + -(-q.shape[0] // PACK_ROWS)] = pack_int8(q)
        sums[lo : lo + q.shape[0]] = row_sums(q)
        scales[lo : lo + q.shape[0]] = s
    b = None if bias is None else bias.detach().float().contiguous()
    return Int8Tiles(tiles, sums, scales, b, reduce_range=not _cpu_has_vnni(), in_features=k)


def quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight:
    """Symmetric per-output-channel int8 (quantize_int8_weight) and fbgemm's packed copy."""
    if not int8_available():
        raise QuantizationUnavailableError("int8 weights need torch's fbgemm quantized engine (not in this build)")
    q, scales = quantize_int8_weight(weight)
    b = None if bias is None else bias.detach().float().contiguous()
    padded = torch.cat((q, q.new_zeros(q.shape[0], 2)), dim=1)  # the range-pin columns multiply zeros
    with warnings.catch_warnings():  # torch 2.13 flags quantized-tensor constructors as deprecated
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros_like(scales, dtype=torch.long)
        qt = torch._make_per_channel_quantized_tensor(padded, scales.double(), zero_points, 0)
        packed = torch.ops.quantized.linear_prepack(qt, None)
    return Int8Weight(q, scales, b, packed, reduce_range=not _cpu_has_vnni(), row_sums=row_sums(q))


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """[n, 1] fp32: max |x| of each row (1 for an all-zero row)."""
    a = x.abs().amax(dim=-1, keepdim=True)
    return a.masked_fill_(a == 0, 1.0)


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """y = x W^T + b, fp32 [n, out], W int8 and each row of x [n, in] quantized on its own grid (fbgemm).

    Reference: int8_linear_ref. Row r of the result depends on row r of x only.
    """
    x = x if x.dtype == torch.float32 else x.float()
    a = _row_scales(x)
    pins = _PINS.expand(x.shape[0], 2)
    y = torch.ops.quantized.linear_dynamic(torch.cat((x / a, pins), dim=1), w.packed, w.reduce_range)
    y.mul_(a)
    return y if w.bias is None else y.add_(w.bias)


_PINS = torch.tensor([[1.0, -1.0]])  # the two range-pin inputs of every row


def int8_linear_ref(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """Plain reference of int8_linear: per row, x / max|x| onto fbgemm's uint8 grid for [-1, 1], the exact
    integer product with the int8 weight, dequantized and scaled back (fp32)."""
    scale, zp, qmax = activation_grid(w.reduce_range)
    out = []
    for row in x.float():
        a = _row_scales(row[None])[0]
        xq = torch.clamp(torch.round((row / a) / scale) + zp, 0, qmax).to(torch.int64)  # [in]
        acc = (xq - zp) @ w.qweight.to(torch.int64).T  # [out], exact
        y = (acc.double() * (scale * w.scales.double())).float() * a
        out.append(y if w.bias is None else y + w.bias)
    return torch.stack(out) if out else x.new_zeros(0, w.qweight.shape[0]).float()
