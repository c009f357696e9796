"""Group-wise 4-bit weights (csrc/linear_int4.c): `quantize_int4` packs a weight, `int4_linear` runs the native
kernel on any number of rows, `int4_linear_ref` is its plain torch reference (equal bit for bit).

Format (like llama.cpp's Q4_0 / Q4_1 blocks, not their bytes): every output row in groups of `group` (32 or 64)
inputs, each group 4-bit codes q in 0..15 with an fp16 scale s, and either symmetric w ~ s (q - 8) (s of least
squared error weighted rms(group) + |w| among 29 fractions of the group's largest-magnitude value, each refit by
weighted least squares: `sym_fit_ref`, csrc recap_int4_sym_fit; until 2026-11-29 unweighted, still sym_fit="lsq")
or asymmetric w ~ s q + m (m, s from the group's min and max; one more fp16 per group). The last group of a row
whose length is not a multiple of the group is zero-padded. Bytes per weight: 4.5 bits (symmetric g32, asymmetric
g64), 5 (asymmetric g32), 4.25 (symmetric g64); benchmarks/bench_int4.py measures their error and speed. A third
format, super-blocks after Q4_K's design (6-bit scales and mins per group of 32, fp16 steps per 256 inputs;
`superblock=True`, format FMT_SB), is kernels/int4_superblock.py's; the same kernel entry point and activations
run it.
Activations: each row in blocks of ACT_BLOCK (256) inputs quantized to int8 (d = max|x| / 127, codes
rint(x / d)), like llama.cpp's Q8_K blocks under its K-quants: a row's result depends on that row only, and an
outlier spoils one block, not its row. Per group, the integer product S = sum q x_q and the codes' sum X are
exact; then in fp32, group after group of a block: symmetric blk += float(S - 8 X) * s, asymmetric
blk += float(S) * s, blk += m * float(X); then acc += blk * d. One step per block rather than per group (as this
format had until 2026-11-28) takes one of the two fp32 multiplies per group and row off the pipes the integer dot
products use (a 512-row prefill ~1.1x faster on AVX-512) for +0.03% perplexity on the trained default model
(docs/performance.md). The kernel does these operations in this order on every path (AVX-512 VNNI, AVX2 with or
without AVX-VNNI, scalar), so every path equals `int4_linear_ref` exactly.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recap.kernels import int4_superblock as SBK
from recap.kernels.int4_superblock import superblock_tile_bytes
from recap.kernels.native import NativeUnavailableError, load_library, raw_function
from recap.kernels.quant_chunks import chunk_rows

GROUPS = (32, 64)
ACT_BLOCK = 256  # inputs per activation step (csrc/linear_int4.c): 8 groups of 32 or 4 of 64
TILE = 16  # output rows per tile (csrc/linear_int4.c)
ISAS = ("scalar", "avx2", "avx2_vnni", "avx512_vnni")  # the kernel's paths, by its isa number
FMT_SB = 2  # the super-block format's number in csrc/linear_int4.c (0 symmetric, 1 asymmetric)
SYM_FITS = ("weighted", "lsq")  # how symmetric scales are picked (_sym_scales); "lsq" the default until 2026-11-29
SYM_FIT_STEPS, SYM_FIT_X0, SYM_FIT_DX = 29, -9.5, 0.125  # the weighted fit's candidates m / x: x = -9.5 .. -6

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass
class Int4Weight:
    """A weight [out_features, in_features] in csrc/linear_int4.c's tiles (one uint8 tensor)."""

    packed: torch.Tensor  # uint8 [ceil(out / 16), groups, block bytes]
    out_features: int
    in_features: int
    group: int  # inputs per group: 32 or 64
    asym: bool  # per-group mins (w ~ s q + m) rather than w ~ s (q - 8)
    bias: torch.Tensor | None  # [out] fp32
    superblock: bool = False  # the super-block format (kernels/int4_superblock.py; group 32, asym False)

    @property
    def groups(self) -> int:
        return -(-self.in_features // self.group)

    @property
    def fmt(self) -> int:
        """The kernel's format number: 0 symmetric, 1 asymmetric, 2 super-blocks (FMT_* in csrc/linear_int4.c)."""
        return FMT_SB if self.superblock else int(self.asym)

    def packed_shape(self) -> tuple[int, ...]:
        """The shape `packed` has: [tiles, groups, block bytes], or for super-blocks [tiles, tile bytes]."""
        tiles = -(-self.out_features // TILE)
        if self.superblock:
            return (tiles, superblock_tile_bytes(self.in_features))
        return (tiles, self.groups, _block_bytes(self.group, self.asym))


def _block_bytes(group: int, asym: bool) -> int:
    return 8 * group + (64 if asym else 32)  # 16 rows x group/2 code bytes, 16 fp16 scales, 16 fp16 mins


def quantize_int4(weight: torch.Tensor, group: int = 32, asym: bool = False, bias: torch.Tensor | None = None,
                  superblock: bool = False, sym_fit: str = "weighted", importance: torch.Tensor | None = None
                  ) -> Int4Weight:  # fmt: skip
    """weight [out, in] (any float dtype) -> Int4Weight; see the module docstring for the two formats, and
    kernels/int4_superblock.py for the third (superblock: groups of 32 in super-blocks of 256; not with asym).
    sym_fit picks the symmetric scales (one of SYM_FITS: _sym_scales); the codes' format is the same either way.
    importance [in] (>= 0, an importance matrix's row: model/importance.py): the weighted fits (symmetric
    "weighted", super-blocks) weigh each weight's error by its input channel's value too; inputs past `in` (a
    ragged last group's zero padding) take 1, as every weight does without one."""
    if sym_fit not in SYM_FITS:
        raise ValueError(f"symmetric int4 fits are {SYM_FITS}, not {sym_fit!r}")
    if importance is not None and (asym and not superblock or sym_fit != "weighted"):
        raise ValueError("an importance matrix weighs the weighted fits only (symmetric 'weighted', super-blocks)")
    if importance is not None and tuple(importance.shape) != (weight.shape[-1],):
        raise ValueError(f"importance {tuple(importance.shape)} for a weight of {weight.shape[-1]} inputs")
    if group not in GROUPS:
        raise ValueError(f"int4 groups are {GROUPS} inputs, not {group}")
    if superblock and (group != SBK.GROUP or asym):
        raise ValueError(f"the int4 super-block format has groups of {SBK.GROUP} and its own mins: not group={group}, "
                         f"asym={asym}")  # fmt: skip
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"quantize_int4 takes a non-empty [out, in] weight, got {tuple(weight.shape)}")
    imp = None if importance is None else F.pad(importance.float(), (0, -weight.shape[1] % group), value=1.0)
    if superblock:
        return _quantize_superblock(weight, bias, imp)
    out, k = weight.shape
    outp = -(-out // TILE) * TILE
    # Rows a chunk at a time (tiles are independent): the fp32 temporaries stay a chunk's size beside a large weight
    # and the chunks go straight into the packed weight (no list of them beside it to concatenate)
    packed = torch.empty(outp // TILE, -(-k // group), _block_bytes(group, asym), dtype=torch.uint8)
    w = weight.detach()
    step = chunk_rows(k, TILE)
    for lo in range(0, outp, step):
        packed[lo // TILE : (lo + step) // TILE] = _pack_rows(w[lo : lo + step], group, asym, sym_fit, imp)
    return Int4Weight(packed, out, k, group, asym, None if bias is None else bias.detach().float().contiguous())


def _quantize_superblock(weight: torch.Tensor, bias: torch.Tensor | None, imp: torch.Tensor | None) -> Int4Weight:
    """quantize_int4(..., superblock=True): a chunk of rows at a time, as the other formats."""
    out, k = weight.shape
    outp = -(-out // TILE) * TILE
    packed = torch.empty(outp // TILE, superblock_tile_bytes(k), dtype=torch.uint8)
    w = weight.detach()
    step = chunk_rows(k, TILE)
    for lo in range(0, outp, step):
        rows = w[lo : lo + step].float()
        rows = F.pad(rows, (0, 0, 0, -(-rows.shape[0] // TILE) * TILE - rows.shape[0]))
        packed[lo // TILE : (lo + step) // TILE] = SBK.pack_superblock(*SBK.quantize_rows(rows, importance=imp))
    return Int4Weight(packed, out, k, SBK.GROUP, False, None if bias is None else bias.detach().float().contiguous(),
                      superblock=True)  # fmt: skip


def _pack_rows(rows: torch.Tensor, group: int, asym: bool, sym_fit: str = "weighted",
               imp: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Rows [r, in] of a weight (a chunk of quant_chunks' size; the last may be short) -> their packed tiles, the rows
    padded to a whole tile and the inputs to whole groups with zeros; imp: per input (padded to whole groups), the
    symmetric weighted fit's importances."""
    r, k = rows.shape
    ng = -(-k // group)
    w = F.pad(rows.float(), (0, ng * group - k, 0, -(-r // TILE) * TILE - r)).view(-1, ng, group)
    if asym:
        lo, hi = w.amin(-1), w.amax(-1)
        s = ((hi - lo) / 15).half()
        m = lo.half()
        s = torch.where(s.float() > 0, s, torch.ones_like(s))
        q = w.sub_(m.float()[..., None]).div_(s.float()[..., None]).round_().clamp_(0, 15)
    else:
        s = _sym_scales(w, sym_fit, imp=None if imp is None else imp.view(1, ng, group).expand_as(w)).half()
        s = torch.where(s.float() != 0, s, torch.ones_like(s))
        q = w.div_(s.float()[..., None]).round_().add_(8).clamp_(0, 15)
        m = None
    if not torch.isfinite(s).all() or (m is not None and not torch.isfinite(m).all()):
        raise ValueError("weight values too large for int4's fp16 scales (|w| up to ~5e5)")
    return pack(q.to(torch.uint8), s, m)


def _sym_scales(w: torch.Tensor, fit: str = "weighted", isa: int | None = None, imp: torch.Tensor | None = None
                ) -> torch.Tensor:  # fmt: skip
    """w [rows, groups, G] fp32 -> symmetric scales [rows, groups] fp32. fit "lsq": with the native library, per
    group the least-squares choice of csrc/linear_int4.c's recap_int4_sym_scales (3-5% less weight error than
    m / -8 on normal weights, in about the time of the rounding), else m / -8 (m: the group's largest-magnitude
    value). fit "weighted": sym_fit_ref, through csrc recap_int4_sym_fit where the native library builds (isa: its
    path, an index into ISAS, tests; default the fastest here: 16 groups a vector on AVX-512, 8 on AVX2; imp: per
    weight importances, w's shape, or None)."""
    w = w.contiguous()
    if fit == "weighted":
        imp = None if imp is None else imp.float().contiguous()
        if not int4_native_available():
            flat = None if imp is None else imp.view(-1, w.shape[2])
            return sym_fit_ref(w.view(-1, w.shape[2]), flat).view(w.shape[:2])
        out = torch.empty(w.shape[:2], device="cpu")
        ip = None if imp is None else imp.data_ptr()
        _lib().recap_int4_sym_fit_isa(w.data_ptr(), ip, out.numel(), w.shape[2], out.data_ptr(),
                                      torch.get_num_threads(), best_isa() if isa is None else isa)  # fmt: skip
        return out
    if int4_native_available():
        out = torch.empty(w.shape[:2], device="cpu")
        _lib().recap_int4_sym_scales(w.data_ptr(), out.numel(), w.shape[2], out.data_ptr(), torch.get_num_threads())
        return out
    return w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0] / -8


def sym_fit_ref(w: torch.Tensor, imp: torch.Tensor | None = None) -> torch.Tensor:
    """Groups w [groups, G] fp32 -> symmetric scales [groups] fp32 (w ~ s q, q in -8..7), the weighted fit:
    weights c_i = rms(w) + |w_i| (as int4_superblock.asym_fit_ref's, llama.cpp's Q4_K without an importance
    matrix), times imp_i where importances imp [groups, G] are given (as Q4_K with one weighs by its channel's
    mean squared activation); candidates s = m / x (m the largest-magnitude value, the first of equals;
    x = -9.5 .. -6 in eighths), each refit by weighted least squares on its codes, the one of least weighted
    error kept (the largest (sum c q w)^2 / sum c q q); 0 for an all-zero group. Sums element by element, as
    csrc recap_int4_sym_fit does (equal bit for bit)."""
    w = w.float().contiguous()
    n = w.shape[1]
    m = w.gather(-1, w.abs().argmax(-1, keepdim=True))[:, 0]  # argmax: the first of equal magnitudes, as the C
    s2 = torch.zeros_like(m)
    for i in range(n):
        s2 = s2 + w[:, i] * w[:, i]
    # sqrt through fp64: torch's fp32 sqrt is not correctly rounded, sqrtf is; the fp64 root rounded to fp32 is
    c = torch.sqrt((s2 / n).double()).float()[:, None] + w.abs()
    c = c if imp is None else c * imp.float()
    best, best_score = m / -8, torch.full_like(m, -1.0)
    for t in range(SYM_FIT_STEPS):
        # a tensor divided (a number over a tensor is its reciprocal times the number: another rounding)
        inv = torch.full_like(m, SYM_FIT_X0 + SYM_FIT_DX * t) / m
        q = torch.round(w * inv[:, None]).clamp_(-8, 7)
        sqw, sqq = torch.zeros_like(m), torch.zeros_like(m)
        for i in range(n):
            cq = c[:, i] * q[:, i]
            sqw = sqw + cq * w[:, i]
            sqq = sqq + cq * q[:, i]
        ok = sqq > 0
        dd = torch.where(ok, sqq, torch.ones_like(sqq))
        score = sqw * sqw / dd
        keep = ok & (score > best_score)
        best, best_score = torch.where(keep, sqw / dd, best), torch.where(keep, score, best_score)
    return torch.where(m == 0, torch.zeros_like(m), best)


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """Codes q [outp, ng, G] uint8 (outp a multiple of 16), fp16 scales and mins [outp, ng] -> the tiles
    [outp / 16, ng, block]: per group G/8 chunks of 16 rows x 4 bytes (codes 8c + b low, 8c + 4 + b high)."""
    outp, ng, group = q.shape
    t = outp // TILE
    q = q.view(t, TILE, ng, group // 8, 2, 4)
    codes = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(t, ng, 8 * group)
    parts = [codes] + [v.view(t, TILE, ng).transpose(1, 2).contiguous().view(torch.uint8).view(t, ng, 32)
                       for v in (scales, mins) if v is not None]  # fmt: skip
    return torch.cat(parts, dim=-1).contiguous()


def unpack_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The codes [outp, kp] int32, scales and mins (None when symmetric) [outp, ng] fp32 of a packed weight
    (formats 0 and 1; int4_superblock.unpack_superblock reads the super-block one)."""
    if w.superblock:
        raise ValueError("unpack_int4 reads formats 0 and 1; a super-block weight: int4_superblock.unpack_superblock")
    p, g = w.packed, w.group
    t, ng, _ = p.shape
    codes = p[..., : 8 * g].reshape(t, ng, g // 8, TILE, 4).permute(0, 3, 1, 2, 4).to(torch.int32)
    q = torch.stack((codes & 15, codes >> 4), dim=-2).reshape(t * TILE, ng * g)

    def halves(at: int) -> torch.Tensor:
        return p[..., at : at + 32].contiguous().view(torch.float16).transpose(1, 2).reshape(t * TILE, ng).float()

    return q, halves(8 * g), halves(8 * g + 32) if w.asym else None


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The weight [out, in] fp32 the codes stand for (error measurements)."""
    if w.superblock:
        return SBK.dequantize_superblock(w.packed, w.out_features, w.in_features)
    q, s, m = unpack_int4(w)
    g = w.group
    qf = q.float().view(q.shape[0], -1, g)
    d = qf * s[..., None] + m[..., None] if m is not None else (qf - 8) * s[..., None]
    return d.reshape(q.shape[0], -1)[: w.out_features, : w.in_features].contiguous()


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, k] fp32 -> codes [n, ng, group] int32 (zero-padded), steps d [n, nb] fp32 (one per ACT_BLOCK inputs),
    code sums [n, ng] int64."""
    n, k = x.shape
    ng = -(-k // group)
    nb = -(-k // ACT_BLOCK)
    xb = F.pad(x, (0, nb * ACT_BLOCK - k)).view(n, nb, ACT_BLOCK)
    d = xb.abs().amax(-1) / 127
    d = torch.where(d > 0, d, torch.ones_like(d))
    xq = torch.round(xb / d[..., None]).clamp_(-127, 127).to(torch.int32)
    xq = xq.view(n, nb * ACT_BLOCK // group, group)[:, :ng]
    return xq, d, xq.sum(-1, dtype=torch.int64)


def int4_linear_ref(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Plain reference of int4_linear: x [n, in] -> [n, out] fp32 (the arithmetic of the module docstring)."""
    x = x.float()
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {w.in_features} inputs")
    if w.superblock:
        return SBK.superblock_linear_ref(x, w.packed, w.out_features, w.in_features, w.bias)
    q, s, m = unpack_int4(w)
    out, g = w.out_features, w.group
    q, s = q[:out].view(out, -1, g).double(), s[:out]
    xq, d, xsum = quantize_activations(x, g)
    acc = x.new_zeros(x.shape[0], out)
    gpb = ACT_BLOCK // g
    for b in range(d.shape[1]):
        blk = x.new_zeros(x.shape[0], out)
        for j in range(b * gpb, min(xq.shape[1], (b + 1) * gpb)):
            prod = (xq[:, j].double() @ q[:, j].T).long()  # exact: |sum| < 2^17
            if m is None:
                blk = blk + (prod - 8 * xsum[:, j, None]).float() * s[None, :, j]
            else:
                blk = blk + prod.float() * s[None, :, j]
                blk = blk + m[None, :out, j] * xsum[:, j, None].float()
        acc = acc + blk * d[:, b, None]
    return acc if w.bias is None else acc + w.bias


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load_library("linear_int4")
    lib.recap_linear_int4.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _INT, _P, _P, _INT, _INT]
    lib.recap_linear_int4.restype = _INT
    lib.recap_int4_sym_scales.argtypes = [_P, _I64, _I64, _P, _INT]
    lib.recap_int4_sym_scales.restype = None
    lib.recap_int4_sym_fit_isa.argtypes = [_P, _P, _I64, _I64, _P, _INT, _INT]
    lib.recap_int4_sym_fit_isa.restype = None
    lib.recap_int4_asym_fit.argtypes = [_P, _P, _I64, _I64, _P, _P, _INT]
    lib.recap_int4_asym_fit.restype = None
    lib.recap_int4_best_isa.argtypes = []
    lib.recap_int4_best_isa.restype = _INT
    lib.recap_int4_isa_supported.argtypes = [_INT]
    lib.recap_int4_isa_supported.restype = _INT
    return lib


@functools.cache
def int4_native_available() -> bool:
    """Whether the int4 kernels build and load here (else Int4Linear runs the reference)."""
    try:
        _lib()
    except NativeUnavailableError:
        return False
    return True


@functools.cache
def best_isa() -> int:
    """The fastest path this CPU runs: an index into ISAS."""
    return int(_lib().recap_int4_best_isa())


@functools.cache
def supported_isas() -> tuple[int, ...]:
    """Every path this CPU runs (indices into ISAS): not always all those below best_isa (an AVX-512 VNNI CPU
    may lack AVX-VNNI)."""
    return tuple(i for i in range(len(ISAS)) if _lib().recap_int4_isa_supported(i))


_ERRORS = {-1: "no memory for the activation codes", -2: "a group other than 32 or 64",
           -3: "an instruction set this CPU lacks", -4: "a weight with no inputs", -5: "an unknown format"}  # fmt: skip


def _check_packed(w: Int4Weight) -> None:
    """The kernel reads w.packed by these sizes: a mismatch would read past it."""
    want = w.packed_shape()
    if w.superblock and (w.group != SBK.GROUP or w.asym):
        raise ValueError(f"a super-block int4 weight has groups of {SBK.GROUP} and asym False, not {w.group}, {w.asym}")
    if (w.group not in GROUPS or tuple(w.packed.shape) != want or w.packed.dtype != torch.uint8
            or not w.packed.is_contiguous()):  # fmt: skip
        raise ValueError(f"packed int4 weight {tuple(w.packed.shape)} {w.packed.dtype} is not the {want} uint8 "
                         f"tiles of a {w.out_features} x {w.in_features} weight in groups of {w.group}")
    if w.bias is not None and (w.bias.shape != (w.out_features,) or w.bias.dtype != torch.float32):
        raise ValueError(f"int4 bias {tuple(w.bias.shape)} {w.bias.dtype} is not [{w.out_features}] fp32")


def _check(rc: int) -> None:
    if rc == -1:
        raise MemoryError("int4_linear: " + _ERRORS[-1])
    if rc != 0:
        raise ValueError("int4_linear: " + _ERRORS.get(rc, f"error {rc}"))


def int4_linear(x: torch.Tensor, w: Int4Weight, isa: int | None = None) -> torch.Tensor:
    """x [n, in] (any float dtype) times the packed weight -> [n, out] fp32 through the native kernel on
    torch.get_num_threads() threads; isa picks a path (tests), default the fastest here. Equals int4_linear_ref."""
    x = x.float().contiguous()
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {w.in_features} inputs")
    _check_packed(w)
    y = torch.empty(x.shape[0], w.out_features, device="cpu")
    b = None if w.bias is None else w.bias.data_ptr()
    _check(_lib().recap_linear_int4(x.data_ptr(), x.shape[0], w.in_features, w.packed.data_ptr(), w.out_features,
                                    w.group, w.fmt, b, y.data_ptr(), torch.get_num_threads(),
                                    best_isa() if isa is None else isa))  # fmt: skip
    return y


def int4_graph_call(w: Int4Weight, x: ctypes.c_void_p, y: ctypes.c_void_p, rows: int,
                    threads: ctypes.c_int) -> tuple[ctypes._CFuncPtr, tuple, str]:
    """int4_linear on `rows` rows at address x [rows, in] into y [rows, out], as a decode graph replays it:
    (function, arguments, what a nonzero return means)."""
    if rows < 1:
        raise ValueError(f"int4_graph_call: {rows} rows")
    _check_packed(w)
    b = None if w.bias is None else w.bias.data_ptr()
    args = (x, _I64(rows), _I64(w.in_features), _P(w.packed.data_ptr()), _I64(w.out_features), _I64(w.group),
            _INT(w.fmt), _P(b), y, threads, _INT(best_isa()))  # fmt: skip
    return raw_function(_lib(), "recap_linear_int4", _INT), args, "int4_linear: no memory or a bad argument"
