"""Int4 weights (kernels/linear_int4.py): the packing, the native kernel on every path this CPU runs against its
torch reference (bit for bit: the integer products are exact and every path does the same fp32 operations in the
same order), batch invariance, the error against fp32, and the Int4Linear layer."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from recap.kernels import linear_int4 as L
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Linear, WeightReleasedError

FORMATS = [(False, 32), (True, 32), (False, 64), (True, 64)]  # (asym, group)
# (out, in): ragged groups and tiles; inputs straddling an activation block (256): one input, one ragged group past it
SHAPES = [(1, 1), (17, 33), (16, 64), (40, 100), (33, 129), (9, 200), (24, 257), (31, 520)]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run


def _isas() -> list[int]:
    return list(L.supported_isas()) if L.int4_native_available() else []


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("asym", "group"), FORMATS)
def test_pack_and_unpack_round_trip(asym: bool, group: int) -> None:
    g = _gen()
    out, k, ng = 21, 70, -(-70 // group)
    q = torch.randint(0, 16, (32, ng, group), generator=g, dtype=torch.uint8)
    s = torch.randn(32, ng, generator=g).half()
    m = torch.randn(32, ng, generator=g).half() if asym else None
    w = L.Int4Weight(L.pack(q, s, m), out, k, group, asym, None)
    assert w.packed.shape == (2, ng, 8 * group + (64 if asym else 32)) and w.packed.dtype == torch.uint8
    uq, us, um = L.unpack_int4(w)
    assert torch.equal(uq, q.view(32, -1).int()) and torch.equal(us, s.float())
    assert um is None if m is None else torch.equal(um, m.float())
    # the kernel's byte layout: chunk c of group j holds row r's codes 8c + b (low nibble) and 8c + 4 + b (high)
    byte = w.packed[1, 0, 64 * 1 + 4 * 3 + 2].item()
    assert (byte & 15, byte >> 4) == (q[16 + 3, 0, 8 + 2].item(), q[16 + 3, 0, 8 + 4 + 2].item())


@pytest.mark.parametrize(("asym", "group"), FORMATS)
def test_quantization_error_is_bounded(asym: bool, group: int) -> None:
    g = _gen()
    w = torch.randn(48, 300, generator=g) * 0.05
    q = L.quantize_int4(w, group, asym)
    d = L.dequantize_int4(q)
    assert d.shape == w.shape
    rel = float((d - w).norm() / w.norm())
    assert 0.02 < rel < 0.12, rel  # 4 bits: ~8-10% on normal weights
    # every value within half a step of its group's grid, or (symmetric) clipped at 7 steps on the side opposite
    # the group's largest-magnitude value
    _, s, _ = L.unpack_int4(q)
    step = s[:48].repeat_interleave(group, 1)[:, :300].abs()
    bound = step * 0.5
    if not asym:
        m = F.pad(w, (0, -300 % group)).view(48, -1, group).abs().amax(-1).repeat_interleave(group, 1)[:, :300]
        bound = torch.maximum(bound, m - 7 * step)
    assert ((d - w).abs() <= bound * 1.001 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64])
def test_symmetric_scales_search_beats_the_plain_scale(group: int) -> None:
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    g = _gen()
    w = torch.randn(64, 16 * group, generator=g) * 0.02
    w[:, 5] = 0.3  # a large value on one side of some groups
    searched = L._sym_scales(w.view(64, 16, group), "lsq")
    plain = w.view(64, 16, group).gather(-1, w.view(64, 16, group).abs().argmax(-1, keepdim=True))[..., 0] / -8

    def err(s: torch.Tensor) -> torch.Tensor:
        wg = w.view(64, 16, group)
        q = (torch.round(wg / s[..., None]) + 8).clamp(0, 15) - 8
        return (wg - q * s[..., None]).square().sum(-1)

    assert (err(searched) <= err(plain) * (1 + 1e-5)).all()  # per group: the plain scale is a candidate
    assert err(searched).sum() < 0.97 * err(plain).sum()


@pytest.mark.parametrize("group", [32, 64])
def test_weighted_fit_native_equals_its_reference(group: int, threads: int) -> None:
    """csrc recap_int4_sym_fit on every path against sym_fit_ref bit for bit: normal groups, outliers, all-zero and
    partly zero groups, equal magnitudes of both signs (the first is m), a group of one value, tiny values."""
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    g = _gen()
    n = 1000 + int(torch.randint(0, 97, (1,), generator=g))
    w = torch.randn(n, group, generator=g) * torch.rand(n, 1, generator=g).add(0.01) * 0.1
    w[::7, int(torch.randint(0, group, (1,), generator=g))] *= 40  # outliers
    w[3] = 0
    w[4, : group // 2] = 0
    w[5, 2], w[5, 9] = w[5].abs().max() * -2, w[5].abs().max() * 2  # a tie: the first (negative) is m
    w[6] = 0
    w[6, 7] = 0.3
    w[8] *= 1e-30
    ref = L.sym_fit_ref(w)
    assert ref[3] == 0 and ref[6] != 0
    for isa in _isas():  # 16 groups a vector on AVX-512, 8 on AVX2, the last n % 16 one by one
        out = L._sym_scales(w.view(1, n, group), "weighted", isa)[0]
        assert torch.equal(out, ref), (L.ISAS[isa], (out != ref).nonzero()[:5])


@pytest.mark.parametrize(("out_f", "in_f"), [(17, 33), (40, 100), (9, 200), (31, 520)])
def test_weighted_fit_quantizes_ragged_rows_by_its_reference(out_f: int, in_f: int) -> None:
    """quantize_int4(sym_fit="weighted"): the last group zero-padded, each group's scale sym_fit_ref's (fp16)."""
    g = _gen()
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    q = L.quantize_int4(w, 32, sym_fit="weighted")
    s = L.sym_fit_ref(F.pad(w, (0, -in_f % 32)).view(-1, 32)).half().float().view(out_f, -1)
    _, us, _ = L.unpack_int4(q)
    assert torch.equal(us[:out_f], torch.where(s != 0, s, torch.ones_like(s)))
    assert L.quantize_int4(w, 32, sym_fit="lsq").packed.shape == q.packed.shape  # the same format
    assert torch.equal(L.quantize_int4(w, 32).packed, q.packed)  # the default fit


@pytest.mark.parametrize("group", [32, 64])
def test_weighted_fit_beats_the_plain_scale_on_its_weighted_error(group: int) -> None:
    """m / -8 (m: the largest-magnitude value) is among the candidates and each is refit by least squares, so per
    group the weighted error is at most m / -8's; and the unweighted error stays near the unweighted search's."""
    g = _gen()
    w = torch.randn(1024, group, generator=g) * 0.02
    w[512::2, 5] = 0.3  # a large value on one side of some groups (the first half: normal groups)
    w[513::4, 11] = -0.12
    c = w.square().mean(-1, keepdim=True).sqrt() + w.abs()

    def err(s: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        q = (torch.round(w / s[:, None]) + 8).clamp(0, 15) - 8
        return (weights * (w - q * s[:, None]).square()).sum(-1)

    fit = L.sym_fit_ref(w)
    plain = w.gather(-1, w.abs().argmax(-1, keepdim=True))[:, 0] / -8
    assert (err(fit, c) <= err(plain, c) * (1 + 1e-5)).all()
    assert err(fit, c)[:512].sum() < 0.95 * err(plain, c)[:512].sum()  # 9-13% less on normal groups
    if L.int4_native_available():
        lsq = L._sym_scales(w.view(1, -1, group), "lsq")[0]
        assert err(fit, c).sum() < err(lsq, c).sum()
        assert err(fit, torch.ones_like(c)).sum() < 1.1 * err(lsq, torch.ones_like(c)).sum()


def test_weighted_fit_without_the_native_library_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C library does not build, quantize_int4 fits by sym_fit_ref: the same codes and scales."""
    g = _gen()
    w = torch.randn(40, 100, generator=g) * 0.05
    w[3, 7] = 1.0
    native = L.quantize_int4(w, 32)
    monkeypatch.setattr(L, "int4_native_available", lambda: False)
    assert torch.equal(L.quantize_int4(w, 32).packed, native.packed)


def test_unknown_symmetric_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="symmetric int4 fits"):
        L.quantize_int4(torch.randn(16, 32), sym_fit="nope")


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 64, 300])
def test_kernel_equals_its_reference_on_every_path(out_f: int, in_f: int, rows: int, threads: int) -> None:
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    g = _gen()
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if (out_f + rows) % 2 else None
    x = torch.randn(rows, in_f, generator=g) * 3
    x[0, : in_f // 2] = 0  # a partly zero row, and (rows > 1) an all-zero row: its steps are 1
    if rows > 1:
        x[1] = 0
    for asym, group in FORMATS:
        q = L.quantize_int4(w, group, asym, b)
        ref = L.int4_linear_ref(x, q)
        assert ref.shape == (rows, out_f)
        for isa in _isas():
            y = L.int4_linear(x, q, isa)
            assert torch.equal(y, ref), f"{L.ISAS[isa]} asym={asym} g{group}: {(y - ref).abs().max()}"


def test_an_outlier_spoils_its_activation_block_only() -> None:
    """Activations take one step per ACT_BLOCK inputs: a large value changes its block's step and codes, not the
    other blocks' (nor other rows')."""
    g = _gen()
    x = torch.randn(2, 3 * L.ACT_BLOCK - 40, generator=g)
    spiked = x.clone()
    spiked[0, L.ACT_BLOCK + 7] = 1000.0
    for group in L.GROUPS:
        (q0, d0, _), (q1, d1, sums) = L.quantize_activations(x, group), L.quantize_activations(spiked, group)
        assert torch.equal(sums, q1.sum(-1))
        assert d0.shape == (2, 3)
        gpb = L.ACT_BLOCK // group
        assert d1[0, 1] == pytest.approx(1000.0 / 127) and d1[0, 1] > 50 * d0[0, 1]
        changed = (q0 != q1).any(-1)  # [rows, groups]
        assert changed[0, gpb : 2 * gpb].any() and not changed[0, :gpb].any() and not changed[0, 2 * gpb :].any()
        assert not changed[1].any() and torch.equal(d0[:, [0, 2]], d1[:, [0, 2]]) and torch.equal(d0[1], d1[1])
        # the codes times their block's step give x back within half a step
        step = d1.repeat_interleave(L.ACT_BLOCK, 1)[:, : x.shape[1]]
        assert ((q1.flatten(1)[:, : x.shape[1]] * step - spiked).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [6, 70])
def test_long_rows_over_several_input_blocks_equal_the_reference(rows: int) -> None:
    """Inputs over several of the AVX2 prefill's K blocks (1024 inputs; the last group ragged) and, at 70 rows, more
    rows than a row block (64) with a remainder of 2: the accumulators carried across blocks are exact."""
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    g = _gen()
    out_f, in_f = 40, 2500
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(rows, in_f, generator=g)
    for asym, group in FORMATS:
        q = L.quantize_int4(w, group, asym, torch.randn(out_f, generator=g))
        ref = L.int4_linear_ref(x, q)
        for isa in _isas():
            assert torch.equal(L.int4_linear(x, q, isa), ref), f"{L.ISAS[isa]} asym={asym} g{group}"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("asym", "group"), FORMATS)
def test_extreme_codes_sum_exactly_on_every_path(asym: bool, group: int, rows: int) -> None:
    """Every code 15 (or 0) against every activation code +-127: the largest integer sums of a group, where the AVX2
    path's int16 pair sums are nearest to overflowing; any wrap would break the equality with the reference."""
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    out_f, in_f = 19, 3 * group
    q = torch.full((32, in_f // group, group), 15, dtype=torch.uint8)
    q[16:] = 0  # the second tile: the smallest code (symmetric: -8)
    scales = torch.ones(32, in_f // group, dtype=torch.float16)
    mins = torch.zeros_like(scales) if asym else None
    w = L.Int4Weight(L.pack(q, scales, mins), out_f, in_f, group, asym, None)
    x = torch.ones(rows, in_f)
    x[:, group : 2 * group] = -1  # codes -127 in the middle group
    if rows > 1:
        x[1] *= -1
    ref = L.int4_linear_ref(x, w)
    for isa in _isas():
        assert torch.equal(L.int4_linear(x, w, isa), ref), L.ISAS[isa]
    sym = 15 - (0 if asym else 8)
    assert ref[0, 0].item() == pytest.approx(sym * in_f / 3, rel=1e-2)  # +g, -g, +g groups of codes 127


def test_a_row_does_not_depend_on_its_batch(threads: int) -> None:
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    g = _gen()
    q = L.quantize_int4(torch.randn(70, 150, generator=g), 32, False, torch.randn(70, generator=g))
    x = torch.randn(37, 150, generator=g)
    x[5] *= 1e4  # a large row beside small ones
    y = L.int4_linear(x, q)
    for r in (0, 5, 8, 36):
        assert torch.equal(L.int4_linear(x[r : r + 1], q), y[r : r + 1])
        assert torch.equal(L.int4_linear(x[r : r + 9], q)[0], y[r])


@pytest.mark.parametrize(("asym", "group"), FORMATS)
def test_error_against_fp32_is_bounded(asym: bool, group: int) -> None:
    g = _gen()
    w, x = torch.randn(256, 512, generator=g) * 0.02, torch.randn(6, 512, generator=g)
    q = L.quantize_int4(w, group, asym)
    y = L.int4_linear(x, q) if L.int4_native_available() else L.int4_linear_ref(x, q)
    exact = F.linear(x.double(), w.double())
    rel = float((y.double() - exact).norm() / exact.norm())
    assert rel < 0.12, rel
    # nearly all of it is the weight rounding: the product with the dequantized weight is within 1.5%
    deq = F.linear(x.double(), L.dequantize_int4(q).double())
    assert float((y.double() - deq).norm() / deq.norm()) < 0.015


def test_bad_inputs_raise_typed_errors() -> None:
    w = torch.randn(8, 40)
    with pytest.raises(ValueError, match="groups"):
        L.quantize_int4(w, 48)
    with pytest.raises(ValueError, match="non-empty"):
        L.quantize_int4(torch.randn(40))
    with pytest.raises(ValueError, match="fp16"):
        L.quantize_int4(w * 1e9)
    q = L.quantize_int4(w)
    with pytest.raises(ValueError, match="does not fit"):
        L.int4_linear_ref(torch.randn(2, 41), q)
    if L.int4_native_available():
        with pytest.raises(ValueError, match="does not fit"):
            L.int4_linear(torch.randn(2, 39), q)
        for isa in sorted(set(range(len(L.ISAS) + 1)) - set(L.supported_isas())):  # refused, never run
            with pytest.raises(ValueError, match="instruction set"):
                L.int4_linear(torch.randn(2, 40), q, isa=isa)
        with pytest.raises(ValueError, match="is not the"):  # the kernel would read past the tiles
            L.int4_linear(torch.randn(2, 40), dataclasses.replace(q, packed=q.packed[:, :1]))
        with pytest.raises(ValueError, match="is not the"):
            L.int4_linear(torch.randn(2, 40), dataclasses.replace(q, out_features=17))
        empty = dataclasses.replace(q, packed=q.packed[:, :0].contiguous(), in_features=0)  # consistent tiles, no input
        with pytest.raises(ValueError, match="no inputs"):
            L.int4_linear(torch.randn(2, 0), empty)


def test_zero_weights_and_rows_give_the_bias() -> None:
    b = torch.randn(20)
    q = L.quantize_int4(torch.zeros(20, 45), 32, False, b)
    assert torch.equal(L.dequantize_int4(q), torch.zeros(20, 45))
    x = torch.randn(3, 45)
    assert torch.equal(L.int4_linear_ref(x, q), b.expand(3, 20))
    assert L.int4_linear_ref(x[:0], q).shape == (0, 20)
    if L.int4_native_available():
        assert torch.equal(L.int4_linear(x, q), b.expand(3, 20))
        assert L.int4_linear(x[:0], q).shape == (0, 20)


@pytest.mark.parametrize("native", [True, False])
def test_int4_linear_layer_keeps_only_the_packed_weight(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    g = _gen()
    lin = Linear(67, 35, bias=True, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(35, 67, generator=g))
        lin.bias.copy_(torch.randn(35, generator=g))
    if not native:
        monkeypatch.setattr(L, "int4_native_available", lambda: False)
        monkeypatch.setattr("recap.model.layers.int4_linear.int4_native_available", lambda: False)
    lin.set_backend("int4")
    assert isinstance(lin.impl, Int4Linear) and lin.backend == "int4"
    q = lin.impl.quantized
    assert lin.released and lin.impl.weight is None  # the packed form is the only copy
    with pytest.raises(WeightReleasedError):
        lin.weight  # noqa: B018
    with pytest.raises(WeightReleasedError):  # 4-bit codes do not give the weight back
        lin.set_backend("onednn")
    x = torch.randn(5, 67, generator=g)
    ref = L.int4_linear_ref(x, q)
    assert torch.equal(lin(x), ref)
    assert torch.equal(lin(x[None])[0], ref)  # leading dimensions
    yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, L.int4_linear_ref(x.bfloat16().float(), q).bfloat16())
    assert lin.impl.tensors() == [q.packed]
    x1, y1 = x[:3].contiguous(), torch.empty(3, 35)
    call = lin.impl.graph_call(x1, y1, 3, ctypes.c_int(1))
    if not native:
        assert call is None
        return
    assert call is not None
    fn, args, _ = call
    assert fn(*args) == 0 and torch.equal(y1, ref[:3])
    moved = q.packed.clone()
    lin.impl.rebind([moved])
    assert lin.impl.quantized.packed is moved and torch.equal(lin(x), ref)
