"""The int4 super-block format (kernels/int4_superblock.py, format 2 of csrc/linear_int4.c): packing, the fit
(native = torch reference bit for bit), its error against symmetric g32, and the kernel on every path this CPU
runs against the torch reference bit for bit (odd widths, inputs not a multiple of 256 or 32, 1-9, 64, 512 rows),
batch invariance."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recap.kernels import int4_superblock as SBK
from recap.kernels import linear_int4 as L

# (out, in): one group; a partial group; a whole super-block; one past it; partial super-blocks of odd group counts
SHAPES = [(1, 1), (17, 33), (16, 256), (9, 257), (40, 300), (33, 520), (31, 800), (24, 1000)]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run


def _isas() -> list[int]:
    return list(L.supported_isas()) if L.int4_native_available() else []


def _native() -> None:
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("k", [32, 200, 256, 300, 520])
def test_pack_and_unpack_round_trip(k: int) -> None:
    g = _gen()
    ng, nsb = -(-k // 32), -(-k // 256)
    q = torch.randint(0, 16, (32, ng, 32), generator=g, dtype=torch.uint8)
    sc = torch.randint(0, 64, (32, ng), generator=g, dtype=torch.uint8)
    mn = torch.randint(0, 64, (32, ng), generator=g, dtype=torch.uint8)
    d, dmin = torch.rand(32, nsb, generator=g).half(), torch.rand(32, nsb, generator=g).half()
    packed = SBK.pack_superblock(q, sc, mn, d, dmin)
    assert packed.shape == (2, SBK.superblock_tile_bytes(k)) == (2, 256 * (ng + nsb))
    uq, usc, umn, ud, udmin = SBK.unpack_superblock(packed, k)
    assert torch.equal(uq, q.view(32, -1).int()) and torch.equal(usc, sc.int()) and torch.equal(umn, mn.int())
    assert torch.equal(ud, d.float()) and torch.equal(udmin, dmin.float())
    # the kernel's bit layout, row j (tile 1, row 5): sc_g in byte g % 4 of A (g < 4) or B; mn_(2i + e)'s low
    # nibble at bit 4i + 16e of N, its high bits at bit 8 (i % 2) + 6 + 16e of A (i < 2) or B
    j = 16 + 5
    aw, bw, nw = (packed[1, :192].view(torch.int32).view(3, 16)[:, 5].long() & 0xFFFFFFFF).tolist()
    for grp in range(min(ng, 8)):
        i, e, word = grp // 2, grp % 2, bw if grp >= 4 else aw
        assert (word >> (8 * (grp % 4))) & 63 == sc[j, grp]
        assert (nw >> (4 * i + 16 * e)) & 15 == mn[j, grp] & 15
        assert (word >> (8 * (i % 2) + 6 + 16 * e)) & 3 == mn[j, grp] >> 4


def test_native_fit_equals_its_reference(threads: int) -> None:
    _native()
    g = _gen()
    w = torch.randn(301, 32, generator=g) * 0.05  # 18 vectors of 16 groups and 13 one by one
    w[0] = 0  # flat at zero
    w[1] = -0.3  # flat below zero: w = -dmin mn
    w[2] = torch.rand(32, generator=g) + 0.5  # all positive: lo = 0
    w[3] = -torch.rand(32, generator=g)  # all negative
    w[4] = torch.randn(32, generator=g) * 1e-30  # subnormal products
    w[5, :31] = 0.1  # one value apart
    w[300] = torch.randn(32, generator=g) * 100  # one by one: the tail
    s_ref, m_ref = SBK.asym_fit_ref(w)
    s, m = SBK.asym_fit(w)
    assert torch.equal(s, s_ref) and torch.equal(m, m_ref)
    assert (s >= 0).all() and (m <= 0).all()


def test_fit_beats_min_max_and_super_blocks_beat_symmetric_g32() -> None:
    g = _gen()
    w = torch.randn(64, 1000, generator=g) * 0.05
    groups = torch.nn.functional.pad(w, (0, 24)).view(-1, 32)
    s, m = SBK.asym_fit(groups)
    q = torch.round((groups - m[:, None]) / s[:, None]).clamp(0, 15)
    fit_err = (q * s[:, None] + m[:, None] - groups).square().sum()
    lo = groups.amin(-1).clamp(max=0)
    s0 = (groups.amax(-1) - lo) / 15
    q0 = torch.round((groups - lo[:, None]) / s0[:, None]).clamp(0, 15)
    assert fit_err < 0.97 * (q0 * s0[:, None] + lo[:, None] - groups).square().sum()
    sb = L.quantize_int4(w, superblock=True)
    sym = L.quantize_int4(w)
    err_sb = float((L.dequantize_int4(sb) - w).norm() / w.norm())
    err_sym = float((L.dequantize_int4(sym) - w).norm() / w.norm())
    assert err_sb < 0.95 * err_sym, (err_sb, err_sym)  # measured ~0.071 vs ~0.081
    assert sb.packed.numel() == sym.packed.numel()  # 32 groups, 4 super-blocks: the same 4.5 bits a weight
    # the codes are those the stored steps give: rint((w + dmin mn) / (d sc)) clamped
    qs, sc, mn, d, dmin = SBK.unpack_superblock(sb.packed, 1000)
    dg = d.repeat_interleave(8, 1)[:, :32] * sc
    mg = dmin.repeat_interleave(8, 1)[:, :32] * mn
    wp = torch.nn.functional.pad(w, (0, 24)).view(64, 32, 32)
    want = torch.round((wp + mg[..., None]) / dg[..., None]).clamp(0, 15)
    assert torch.equal(qs.view(64, 32, 32).float(), torch.where(dg[..., None] > 0, want, 0))


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_kernel_equals_its_reference_on_every_path(out_f: int, in_f: int, rows: int, threads: int) -> None:
    _native()
    g = _gen()
    w = L.quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.05, bias=torch.randn(out_f, generator=g),
                        superblock=True)  # fmt: skip
    x = torch.randn(rows, in_f, generator=g)
    want = L.int4_linear_ref(x, w)
    for isa in _isas():
        assert torch.equal(L.int4_linear(x, w, isa=isa), want), (L.ISAS[isa], out_f, in_f, rows)


@pytest.mark.parametrize("rows", [35, 64, 512])  # 35: the prefill passes from 32 rows, 3 rows left
def test_prefill_rows_equal_the_reference(rows: int, threads: int) -> None:
    _native()
    g = _gen()
    for out_f, in_f in ((70, 520), (33, 800)):  # odd tile counts: a tile left after the pairs
        w = L.quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.05, superblock=True)
        x = torch.randn(rows, in_f, generator=g) * 3
        want = L.int4_linear_ref(x, w)
        for isa in _isas():
            assert torch.equal(L.int4_linear(x, w, isa=isa), want), (L.ISAS[isa], out_f, in_f, rows)


@pytest.mark.parametrize("rows", [1, 8])
def test_extreme_codes_sum_exactly_on_every_path(rows: int) -> None:
    _native()
    out_f, in_f = 16, 520
    ng, nsb = 17, 3
    q = torch.full((16, ng, 32), 15, dtype=torch.uint8)
    full = torch.full((16, ng), 63, dtype=torch.uint8)
    d = torch.full((16, nsb), 0.5).half()
    w = L.Int4Weight(SBK.pack_superblock(q, full, full, d, d), out_f, in_f, 32, False, None, superblock=True)
    x = torch.full((rows, in_f), -1.0)
    x[:, ::3] = 1.0
    want = L.int4_linear_ref(x, w)
    for isa in _isas():
        assert torch.equal(L.int4_linear(x, w, isa=isa), want), L.ISAS[isa]
    dense = L.dequantize_int4(w)
    assert torch.allclose(want, x @ dense.T, rtol=1e-2)


def test_a_row_does_not_depend_on_its_batch(threads: int) -> None:
    _native()
    g = _gen()
    w = L.quantize_int4(torch.randn(72, 600, generator=g) * 0.05, superblock=True)
    x = torch.randn(21, 600, generator=g)
    for isa in _isas():
        batch = L.int4_linear(x, w, isa=isa)
        for r in (0, 7, 20):
            assert torch.equal(L.int4_linear(x[r : r + 1], w, isa=isa), batch[r : r + 1]), L.ISAS[isa]
            assert torch.equal(L.int4_linear(x[r : r + 9], w, isa=isa)[0], batch[r]), L.ISAS[isa]


def test_bad_arguments_raise() -> None:
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="super-block"):
        L.quantize_int4(w, group=64, superblock=True)
    with pytest.raises(ValueError, match="super-block"):
        L.quantize_int4(w, asym=True, superblock=True)
    q = L.quantize_int4(w, superblock=True)
    assert q.fmt == L.FMT_SB and q.packed_shape() == tuple(q.packed.shape) == (1, 768)  # a header, 2 groups
    with pytest.raises(ValueError, match="unpack_superblock"):
        L.unpack_int4(q)
    bad = L.Int4Weight(q.packed[:, :512].contiguous(), 16, 64, 32, False, None, superblock=True)
    with pytest.raises(ValueError, match="packed int4 weight"):
        L.int4_linear(torch.randn(2, 64), bad)
