"""The int4 super-block format (format 2 of csrc/linear_int4.c, after llama.cpp's Q4_K design, not its bytes):
its quantizer, packing and torch reference.

Per output row, inputs in super-blocks of SB (256) = 8 groups of 32 (a row's last super-block holds only its own
groups: ceil(in / 32) groups in all, the last zero-padded); codes q in 0..15; per super-block two fp16 steps d and
dmin, per group a 6-bit scale sc and a 6-bit min mn:  w ~ d sc q - dmin mn.  Bytes: 4 bits a code, 12 bits a group,
32 a super-block: 4.5 bits a weight, as symmetric g32 (one fp16 scale a group), but two numbers per group (an
offset: a group need not be centred on 0) and their steps per super-block.

Quantizer, per group w[32] (`asym_fit_ref`, csrc `recap_int4_asym_fit` equal to it bit for bit): lo = min(0, min w),
range = max w - lo; for each of FIT_STEPS candidate inverse steps (14 + t / 8) / range the codes
clamp(rint((w - lo) * iscale), 0, 15), then the least-squares (s, m) of w ~ s q + m on them, each value weighted
c_i = rms(w) + |w_i| as llama.cpp's Q4_K does without an importance matrix (m > 0 is refit with m = 0: the stored
min is -dmin mn <= 0), kept where its weighted squared error is the least (the weights: mean KL from fp32 -12% on
the trained default model against the plain fit). Then per super-block
d = max s / 63, dmin = max(-m) / 63 (fp16), sc = rint(s / d), mn = rint(-m / dmin) (0..63), and the codes picked
again on the grid those give: q = clamp(rint((w + dmin mn) / (d sc)), 0, 15).
Sums go element after element in fp32 (no fused multiply-add) so that the native fit, vectorized across groups,
does the very same operations.

Tile layout (`pack_superblock`): tiles of 16 output rows, each a stream of super-blocks; a super-block of gs
groups is META (256) bytes, then gs group blocks of 256 bytes (the code chunks of symmetric g32: 4 chunks of
16 rows x 4 bytes). META: three arrays of 16 uint32 (one per row) A, B, N, then 16 fp16 d, then 16 fp16 dmin.
Scales: sc_g in bits 0-5 of byte g of A (g < 4), of byte g - 4 of B (g >= 4): one shift and one AND each. Mins,
pair i = groups 2i, 2i + 1: low nibbles at bits 4i and 16 + 4i of N; high 2 bits in bits 6-7 of bytes b and
b + 2 (b = i & 1) of A (i < 2) or B (i >= 2). So ((N >> 4i) & 0x000F000F) | ((A or B >> 8b + 2) & 0x00300030)
is the pair (mn_2i, mn_2i+1) as two int16 per lane: one vpdpwssd / vpmaddwd against the activations' group-sum
pairs gives mn_2i X_2i + mn_2i+1 X_2i+1. 12 bytes a row and super-block, as Q4_K's scales.

Kernel arithmetic (int4_linear_ref here, every native path the same, in the same order): per row and super-block
b, per group g: S = sum q x_q (exact int32), blk += float(S) * (d * sc) (d * sc exact in fp32: 11 x 6 bits); then
M = sum_g mn X_g (exact int32; X_g the group's sum of activation codes), blk += float(M) * (-dmin); then
acc += blk * x_step[b].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SB = 256  # inputs per super-block (= the activation block, linear_int4.ACT_BLOCK)
GROUP = 32
GPS = SB // GROUP  # groups per super-block
META = 256  # bytes of a tile's super-block header
GROUP_BYTES = 256  # 16 rows x 32 codes / 2
TILE = 16
FIT_STEPS = 17  # candidate inverse steps (14 + t / 8) / range, t = 0..16: around the min-max 15 / range


def superblock_tile_bytes(in_features: int) -> int:
    """Bytes of one tile (16 rows) of an [out, in_features] weight: META per super-block, GROUP_BYTES per group."""
    ng = -(-in_features // GROUP)
    return META * -(-ng // GPS) + GROUP_BYTES * ng


# ---------------------------------------------------------------- the fit


def asym_fit_ref(w: torch.Tensor, imp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups w [groups, 32] fp32 -> per group (s, m) fp32 of w ~ s q + m, s >= 0, m <= 0 (module docstring), by
    least squares weighted c_i = rms(w) + |w_i|, times imp_i where importances imp [groups, 32] are given (an
    importance matrix's: linear_int4.quantize_int4). Sums element by element, as csrc recap_int4_asym_fit does lane by
    lane (equal bit for bit)."""
    w = w.float().contiguous()
    n = w.shape[1]
    zero = torch.zeros((), dtype=torch.float32)
    lo = torch.minimum(w.amin(-1), zero)
    rng = w.amax(-1) - lo
    wl = w - lo[:, None]
    s2 = torch.zeros_like(lo)
    for i in range(n):
        s2 = s2 + w[:, i] * w[:, i]
    # sqrt through fp64: torch's fp32 sqrt is not correctly rounded (17% of values a unit off), sqrtf is; the fp64
    # root rounded to fp32 is
    c = torch.sqrt((s2 / n).double()).float()[:, None] + w.abs()  # the weights
    c = c if imp is None else c * imp.float()
    cs, cw = torch.zeros_like(lo), torch.zeros_like(lo)
    for i in range(n):
        cs = cs + c[:, i]
        cw = cw + c[:, i] * w[:, i]
    best_s, best_m = rng / 15, lo.clone()
    best_e = torch.full_like(lo, float("inf"))
    for t in range(FIT_STEPS):
        # 14 + t/8 is exact in fp32; a tensor divided (a number over a tensor is its reciprocal times the number:
        # another rounding); inf / nan where rng = 0 (not kept below)
        iscale = torch.full_like(rng, 14.0 + 0.125 * t) / rng
        q = torch.round(wl * iscale[:, None]).clamp_(0, 15)
        sl, sll, slw = torch.zeros_like(lo), torch.zeros_like(lo), torch.zeros_like(lo)
        for i in range(n):
            cq = c[:, i] * q[:, i]
            sl = sl + cq
            sll = sll + cq * q[:, i]
            slw = slw + cq * w[:, i]
        den = cs * sll - sl * sl
        ok = den > 0
        dd = torch.where(ok, den, torch.ones_like(den))
        s = (cs * slw - sl * cw) / dd
        m = (sll * cw - sl * slw) / dd
        pos = m > 0
        s = torch.where(pos, slw / torch.where(sll > 0, sll, torch.ones_like(sll)), s)
        m = torch.where(pos, zero, m)
        s = torch.clamp_min(s, 0)
        e = torch.zeros_like(lo)
        for i in range(n):
            r = s * q[:, i] + m - w[:, i]
            e = e + c[:, i] * (r * r)
        keep = ok & (e < best_e)
        best_s, best_m = torch.where(keep, s, best_s), torch.where(keep, m, best_m)
        best_e = torch.where(keep, e, best_e)
    flat = rng == 0  # every value equal (to lo <= 0): no codes needed
    return torch.where(flat, zero, best_s), torch.where(flat, lo, best_m)


def asym_fit(w: torch.Tensor, imp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """asym_fit_ref through the native library where it builds (the same results, ~100x faster)."""
    from recap.kernels.linear_int4 import _lib, int4_native_available  # it imports this module

    if not int4_native_available():
        return asym_fit_ref(w, imp)
    w = w.float().contiguous()
    imp = None if imp is None else imp.float().contiguous()
    s, m = torch.empty(w.shape[0]), torch.empty(w.shape[0])
    _lib().recap_int4_asym_fit(w.data_ptr(), None if imp is None else imp.data_ptr(), w.shape[0], w.shape[1],
                               s.data_ptr(), m.data_ptr(), torch.get_num_threads())  # fmt: skip
    return s, m


# ---------------------------------------------------------------- super-block steps and codes


def quantize_rows(rows: torch.Tensor, fit=asym_fit, importance: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Rows [r, in] (r a multiple of 16) -> codes [r, ng, 32] uint8, 6-bit sc and mn [r, ng] uint8, fp16 d and
    dmin [r, nsb]: the fit per group (weighted by importance [32 ng], per input, where given), its steps per
    super-block, the codes picked again on their grid."""
    r, k = rows.shape
    ng = -(-k // GROUP)
    nsb = -(-ng // GPS)
    w = F.pad(rows.float(), (0, ng * GROUP - k)).view(r, ng, GROUP)
    imp = None if importance is None else importance.view(1, ng, GROUP).expand(r, ng, GROUP).reshape(-1, GROUP)
    s, m = fit(w.reshape(-1, GROUP), imp)
    s, m = s.view(r, ng), -m.view(r, ng)  # m: the min's magnitude (>= 0)
    pad = nsb * GPS - ng  # groups of the last super-block it does not hold: 0 (no part in the maxima)
    s8, m8 = F.pad(s, (0, pad)).view(r, nsb, GPS), F.pad(m, (0, pad)).view(r, nsb, GPS)
    d, dmin = (s8.amax(-1) / 63).half(), (m8.amax(-1) / 63).half()
    if not (torch.isfinite(d).all() and torch.isfinite(dmin).all()):
        raise ValueError("weight values too large for int4's fp16 steps (|w| up to ~4e6)")
    df, dmf = d.float(), dmin.float()

    def six(v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        st = step[..., None]
        q = torch.where(st > 0, torch.round(v / torch.where(st > 0, st, torch.ones_like(st))), torch.zeros_like(v))
        return q.clamp_(0, 63).reshape(r, -1)[:, :ng]

    sc, mn = six(s8, df), six(m8, dmf)
    dg = df.repeat_interleave(GPS, 1)[:, :ng] * sc  # exact: an 11-bit by a 6-bit integer
    mg = dmf.repeat_interleave(GPS, 1)[:, :ng] * mn
    q = torch.round((w + mg[..., None]) / torch.where(dg > 0, dg, torch.ones_like(dg))[..., None]).clamp_(0, 15)
    q = torch.where(dg[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.uint8), sc.to(torch.uint8), mn.to(torch.uint8), d, dmin


# ---------------------------------------------------------------- packing


_G = torch.arange(GPS)
_SC_SHIFT = 8 * (_G % 4)  # sc_g: bits 0-5 of byte g % 4 of A (g < 4) or B
_MN_LO_SHIFT = 4 * (_G // 2) + 16 * (_G % 2)  # mn_g's low nibble in N
_MN_HI_SHIFT = 8 * ((_G // 2) % 2) + 6 + 16 * (_G % 2)  # its high bits in A (g < 4) or B
_IN_B = _G >= 4


def _words(sc: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sc, mn [r, nsb, 8] (0..63) -> the words A, B, N [r, nsb] int64 (module docstring)."""
    a_or_b = (sc.long() << _SC_SHIFT) | ((mn.long() >> 4) << _MN_HI_SHIFT)  # each group's bits in its word
    a, b = a_or_b[..., ~_IN_B].sum(-1), a_or_b[..., _IN_B].sum(-1)  # disjoint bits: the sum is the OR
    return a, b, ((mn.long() & 15) << _MN_LO_SHIFT).sum(-1)


def pack_superblock(q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor,
                    dmin: torch.Tensor) -> torch.Tensor:
    """Codes q [outp, ng, 32] uint8 (outp a multiple of 16), sc, mn [outp, ng] (0..63), d, dmin [outp, nsb] fp16 ->
    the tiles [outp / 16, superblock_tile_bytes(32 ng)] uint8 (module docstring)."""
    from recap.kernels.linear_int4 import pack  # the g32 code chunks

    outp, ng, _ = q.shape
    t, nsb = outp // TILE, -(-ng // GPS)
    codes = pack(q, torch.zeros(outp, ng, dtype=torch.float16), None)[..., : GROUP_BYTES]  # [t, ng, 256]
    pad = nsb * GPS - ng
    sc8 = F.pad(sc.long(), (0, pad)).view(outp, nsb, GPS)
    mn8 = F.pad(mn.long(), (0, pad)).view(outp, nsb, GPS)
    aw, bw, nw = _words(sc8, mn8)

    def rows_u8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [outp, nsb] -> [t, nsb, 16 x itemsize]
        v = v.to(dtype) if dtype != torch.int32 else v.to(torch.int64).where(v < 2**31, v - 2**32).to(torch.int32)
        return v.view(t, TILE, nsb).transpose(1, 2).contiguous().view(torch.uint8).view(t, nsb, -1)

    meta = torch.cat([rows_u8(aw, torch.int32), rows_u8(bw, torch.int32), rows_u8(nw, torch.int32),
                      rows_u8(d, torch.float16), rows_u8(dmin, torch.float16)], dim=-1)  # fmt: skip
    out = torch.empty(t, superblock_tile_bytes(ng * GROUP), dtype=torch.uint8)
    at = 0
    for b in range(nsb):
        gs = min(GPS, ng - b * GPS)
        out[:, at : at + META] = meta[:, b]
        out[:, at + META : at + META + gs * GROUP_BYTES] = codes[:, b * GPS : b * GPS + gs].reshape(t, -1)
        at += META + gs * GROUP_BYTES
    return out


def unpack_superblock(packed: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    """The tiles -> codes [outp, kp] int32, sc, mn [outp, ng] int32, d, dmin [outp, nsb] fp32."""
    t = packed.shape[0]
    ng = -(-in_features // GROUP)
    nsb = -(-ng // GPS)
    metas, codes = [], []
    at = 0
    for b in range(nsb):
        gs = min(GPS, ng - b * GPS)
        metas.append(packed[:, at : at + META])
        codes.append(packed[:, at + META : at + META + gs * GROUP_BYTES].reshape(t, gs, GROUP_BYTES))
        at += META + gs * GROUP_BYTES
    meta = torch.stack(metas, 1)  # [t, nsb, 256]

    def rows(lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:  # -> [outp, nsb]
        return meta[..., lo:hi].contiguous().view(dtype).transpose(1, 2).reshape(t * TILE, nsb)

    aw, bw, nw = (rows(64 * i, 64 * i + 64, torch.int32).long() & 0xFFFFFFFF for i in range(3))
    d, dmin = rows(192, 224, torch.float16).float(), rows(224, 256, torch.float16).float()
    word = torch.where(_IN_B, bw[..., None], aw[..., None])  # [outp, nsb, 8]: each group's A or B
    sc = (word >> _SC_SHIFT) & 63
    mn = ((nw[..., None] >> _MN_LO_SHIFT) & 15) | (((word >> _MN_HI_SHIFT) & 3) << 4)
    c = torch.cat(codes, 1).reshape(t, ng, 4, TILE, 4).permute(0, 3, 1, 2, 4).to(torch.int32)
    q = torch.stack((c & 15, c >> 4), dim=-2).reshape(t * TILE, ng * GROUP)
    return (q, sc.reshape(t * TILE, -1)[:, :ng].int(), mn.reshape(t * TILE, -1)[:, :ng].int(), d, dmin)


def dequantize_superblock(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [out, in] fp32 the codes stand for: d sc q - dmin mn."""
    q, sc, mn, d, dmin = unpack_superblock(packed, in_features)
    ng = sc.shape[1]
    dg = d.repeat_interleave(GPS, 1)[:, :ng] * sc
    mg = dmin.repeat_interleave(GPS, 1)[:, :ng] * mn
    w = q.float().view(q.shape[0], ng, GROUP) * dg[..., None] - mg[..., None]
    return w.reshape(q.shape[0], -1)[:out_features, :in_features].contiguous()


# ---------------------------------------------------------------- the reference product


def superblock_linear_ref(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] fp32 times the packed weight -> [n, out] fp32 (the module docstring's arithmetic, in its order)."""
    from recap.kernels.linear_int4 import quantize_activations

    q, sc, mn, d, dmin = unpack_superblock(packed, in_features)
    out = out_features
    ng = sc.shape[1]
    q = q[:out].view(out, ng, GROUP).double()
    dsc = d[:out].repeat_interleave(GPS, 1)[:, :ng] * sc[:out].float()
    mn, ndmin = mn[:out].long(), -dmin[:out]
    xq, xd, xsum = quantize_activations(x, GROUP)
    acc = x.new_zeros(x.shape[0], out)
    for b in range(xd.shape[1]):
        blk = x.new_zeros(x.shape[0], out)
        g0, g1 = b * GPS, min(ng, (b + 1) * GPS)
        for j in range(g0, g1):
            prod = (xq[:, j].double() @ q[:, j].T).long()  # exact: |sum| < 2^17
            blk = blk + prod.float() * dsc[None, :, j]
        mins = xsum[:, g0:g1] @ mn[:, g0:g1].T  # exact int64 (fits int32: 8 x 63 x 4064)
        blk = blk + mins.float() * ndmin[None, :, b]
        acc = acc + blk * xd[:, b, None]
    return acc if bias is None else acc + bias
