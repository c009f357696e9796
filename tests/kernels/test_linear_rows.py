"""The native few-row kernels (kernels/linear_rows.py, kernels/rms_norm.py) against their references, alone and
in a layer."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recap.kernels import linear_rows as lr
from recap.kernels import native
from recap.kernels.linear_rows import activation_grid
from recap.kernels.rms_norm import rms_norm_available, rms_norm_rows, rms_norm_rows_ref, use_rms_norm_rows
from recap.model.layers.linear import DenseLinear, Int8Linear, Linear, WeightReleasedError
from recap.model.quant import int8_linear, int8_linear_ref, quantize_int8

SHAPES = [(1, 1), (7, 15), (8, 16), (9, 17), (33, 63), (5, 64), (17, 65), (40, 100), (12, 129), (300, 768)]


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    if not lr.linear_rows_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_f32_matches_f_linear(out_f: int, in_f: int, rows: int, threads: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if (out_f + rows) % 2 else None
    x = torch.randn(rows, in_f, generator=g)
    y = lr.linear_rows_f32(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (rows, out_f) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * in_f**0.5)
    torch.testing.assert_close(y, lr.linear_rows_f32_ref(x, w, b), rtol=1e-5, atol=2e-6 * in_f**0.5)


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_int8_equals_its_reference_bit_for_bit(out_f: int, in_f: int, rows: int, reduce_range: bool,
                                               threads: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if out_f % 2 else None
    q0 = quantize_int8(w, b)
    q = dataclasses.replace(q0, reduce_range=reduce_range)  # both grids, whatever this CPU's default
    x = torch.randn(rows, in_f, generator=g) * 3
    x[0, : in_f // 2] = 0  # a partly zero row, and (rows > 1) an all-zero row: its scale is 1
    if rows > 1:
        x[1] = 0
    y = lr.linear_rows_int8(x, lr.pack_int8(q.qweight), q.row_sums, q.scales, q.bias, q.reduce_range)
    assert torch.equal(y, int8_linear_ref(x, q))
    if reduce_range == q0.reduce_range:
        # fbgemm (the prefill path) on its own grid: the same products, except where it rounds an activation on
        # a grid tie the other way (it multiplies by the inverse scale): a step of one grid point there
        step = activation_grid(reduce_range)[0] * x.abs().amax(1, keepdim=True).clamp_min(1e-30) * w.abs().max()
        assert ((y - int8_linear(x, q)).abs() <= 2 * step + 1e-5 * y.abs() + 1e-6).all()


# (out, in): odd widths; in 2500 spans two k-blocks of the GEMM (2048 bytes each); rows up to 517 span
# several row blocks at every width
GEMM_SHAPES = [(13, 2500), (70, 1100), (9, 77), (130, 63)]
GEMM_ROWS = [1, 2, 7, 9, 33, 130, 517]


def _int8_case(out_f: int, in_f: int, rows: int, seed: int) -> tuple[torch.Tensor, object]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if (out_f + seed) % 2 else None
    x = torch.randn(rows, in_f, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    x[0, : in_f // 3] = 0
    if rows > 4:
        x[3] = 0  # an all-zero row: its scale is 1
    return x, quantize_int8(w, b)


def _int8(x: torch.Tensor, q: object, library: object = None) -> torch.Tensor:
    return lr.linear_rows_int8(x, lr.pack_int8(q.qweight), q.row_sums, q.scales, q.bias, q.reduce_range,
                               library=library)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize(("out_f", "in_f"), GEMM_SHAPES)
@pytest.mark.parametrize("rows", GEMM_ROWS)
def test_int8_gemm_equals_its_reference_bit_for_bit(out_f: int, in_f: int, rows: int, threads: int) -> None:
    """Every row count (1: the one-row path, more: the GEMM over the same tiles) is the reference exactly."""
    x, q = _int8_case(out_f, in_f, rows, torch.seed() % 2**31)
    y = _int8(x, q)
    assert y.shape == (rows, out_f)
    assert torch.equal(y, int8_linear_ref(x, q))


@pytest.mark.parametrize(("out_f", "in_f"), GEMM_SHAPES[:2])
def test_int8_rows_are_batch_invariant(out_f: int, in_f: int) -> None:
    """A row's output is the same bit for bit whatever rows it is batched with, in whatever order, at either
    thread count: the integer sums are exact, and the epilogue is per row."""
    x, q = _int8_case(out_f, in_f, 300, torch.seed() % 2**31)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _int8(x, q)
        g = torch.Generator().manual_seed(torch.seed() % 2**31)
        for n in (1, 2, 3, 8, 9, 61, 299):
            idx = torch.randperm(300, generator=g)[:n]
            assert torch.equal(_int8(x[idx], q), whole[idx])
        torch.set_num_threads(2)
        assert torch.equal(_int8(x, q), whole)
        assert torch.equal(_int8(x[5:6], q), whole[5:6])
        assert _int8(x[:0], q).shape == (0, out_f)  # no rows: nothing to compute
    finally:
        torch.set_num_threads(before)


# Other instruction sets' paths, built here with the wider ones switched off: AVX2 with AVX-VNNI (where the
# compiler and CPU have it), AVX2 alone (7-bit activations through int16 pairs; 8-bit ones: portable), portable.
ISA_BUILDS = {"avx2-vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni"),
              "portable": ("-mno-avx512f", "-mno-avxvnni", "-mno-avx2")}


@pytest.mark.parametrize("isa", list(ISA_BUILDS))
@pytest.mark.parametrize("rows", [1, 3, 9, 130])
def test_int8_paths_of_other_instruction_sets_equal_the_reference(isa: str, rows: int) -> None:
    try:
        lib = lr.int8_library(ISA_BUILDS[isa])
    except native.NativeUnavailableError as e:  # a compiler without these flags
        pytest.skip(f"cannot build the {isa} path here: {e}")
    for out_f, in_f in GEMM_SHAPES:
        x, q0 = _int8_case(out_f, in_f, rows, torch.seed() % 2**31)
        for q in (dataclasses.replace(q0, reduce_range=r) for r in (False, True)):  # both grids
            assert torch.equal(_int8(x, q, lib), int8_linear_ref(x, q))


def test_int8_kernel_refuses_widths_past_its_exact_range() -> None:
    q = torch.zeros(8, lr.MAX_INT8_IN + 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="at most"):
        lr.linear_rows_int8(torch.zeros(1, q.shape[1]), lr.pack_int8(q), q.sum(1, dtype=torch.int32),
                            torch.ones(8), None, False)  # fmt: skip


def test_pack_int8_lays_tiles_out_as_one_stream() -> None:
    q = torch.randint(-127, 128, (11, 70), dtype=torch.int8)
    p = lr.pack_int8(q)
    assert p.shape == (2, 2, 8, 64) and p.is_contiguous()
    for o in range(11):
        for k in range(70):
            assert p[o // 8, k // 64, o % 8, k % 64] == q[o, k]
    assert (p[1, :, 3:] == 0).all() and (p[:, 1, :, 6:] == 0).all()  # the padding is zero


def test_only_single_rows_take_the_kernels() -> None:
    assert lr.use_linear_rows(torch.zeros(1, 4))
    assert not lr.use_linear_rows(torch.zeros(2, 4))
    assert not lr.use_linear_rows(torch.zeros(4))


def test_a_missing_compiler_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeUnavailableError, match="no C compiler"):
        native.load_library.__wrapped__("linear_rows")


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "broken.c").write_text("int f(void) { return nope; }\n")
    monkeypatch.setattr(native, "CSRC", tmp_path)
    with pytest.raises(native.NativeUnavailableError, match="nope"):
        native.load_library.__wrapped__("broken")


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 65, 131])
def test_f32_panels_match_f_linear(out_f: int, in_f: int, rows: int, threads: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if (out_f + rows) % 2 else None
    x = torch.randn(rows, in_f, generator=g)
    panels = lr.pack_panels(w)
    assert panels.shape == (-(-out_f // lr.PANEL), in_f, lr.PANEL)
    y = lr.linear_panels_f32(x, panels, b, out_f)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (rows, out_f) and y.dtype == torch.float32
    # one sequential fp32 sum per output: within the dot product's forward error bound, (k + 1) u sum |x w|
    bound = (in_f + 2) * 2.0**-24 * (F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.abs()))
    err = (y.double() - ref).abs()
    assert (err <= bound + 1e-30).all(), f"max error {err.max():.3g} above its bound at {(err / bound).argmax()}"
    with pytest.raises(ValueError, match="do not fit"):
        lr.linear_panels_f32(torch.randn(rows, in_f + 1), panels, b, out_f)


@pytest.mark.skipif(" avx2" not in native._cpu_flags(), reason="the AVX2 panel kernels")
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 16])
def test_f32_panels_avx2_rows_do_not_depend_on_their_batch(rows: int) -> None:
    """On AVX2 every output is one FMA chain over k in order at any row count: each row of a batch equals that
    row alone, bit for bit (a verify step's logits then equal a decode step's). An AVX-512 CPU runs an AVX2
    build (its own one-row kernel sums k in two halves)."""
    lib = lr._lib(("-mno-avx512f",) if " avx512f" in native._cpu_flags() else ())
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 300, generator=g), torch.randn(rows, 300, generator=g)
    panels = lr.pack_panels(w)
    batched = lr.linear_panels_f32(x, panels, None, 200, lib)
    alone = torch.cat([lr.linear_panels_f32(x[r : r + 1], panels, None, 200, lib) for r in range(rows)])
    assert torch.equal(batched, alone)


def test_linear_layer_routes_every_row_count_to_the_panels() -> None:
    """fp32 on "onednn" with the native kernels: the panels are the one layout (every row count, the weight
    parameter released); on "torch" (the reference keeps its parameter) only 1..PANEL_ROWS rows take them."""
    layer = Linear(40, 70, bias=True, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.set_backend("onednn", native=True)
    assert len(layer.impl.tensors()) == 1 and layer.released  # the panels, and nothing else
    calls: list[int] = []
    real = lr.linear_panels_f32

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    import recap.model.layers.linear as linear_mod

    linear_mod.linear_panels_f32, saved = counted, linear_mod.linear_panels_f32  # type: ignore[assignment]
    try:
        for n in (1, 2, 8, 9, 32, 33, 64, 200):
            x = torch.randn(n, 40)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert calls == [1, 2, 8, 9, 32, 33, 64, 200]
        calls.clear()
        layer.set_backend("torch", native=False)  # the weight comes back from the panels, exactly
        assert not layer.released and torch.equal(layer.weight, w) and not layer.impl.tensors()
        layer.set_native(True)
        for n in (1, 32, 33):
            x = torch.randn(n, 40)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert calls == [1, 32]  # the reference: more rows through F.linear
    finally:
        linear_mod.linear_panels_f32 = saved  # type: ignore[assignment]
    layer.set_backend("int8")
    assert layer.impl.native and layer.impl.tensors()[0].dtype == torch.int8  # int8 weights: tiles, no panels


def test_linear_layer_routes_one_row_and_keeps_the_backend_for_more() -> None:
    layer = Linear(24, 10, bias=True, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w = layer.weight.detach().clone()
    layer.set_backend("onednn")
    layer.set_native(True)
    x = torch.randn(3, 24)
    torch.testing.assert_close(torch.cat([layer(x[i : i + 1]) for i in range(3)]), layer(x), rtol=1e-5, atol=1e-5)
    layer.set_backend("int8")  # the bound kernel follows the backend: int8 tiles
    assert isinstance(layer.impl, Int8Linear) and layer.impl.native and layer.released
    with pytest.raises(WeightReleasedError):  # the fp32 weight was freed once quantized
        layer.set_backend("onednn")
    fresh = Linear(24, 10, bias=True, dtype=torch.float32)
    with torch.no_grad():
        fresh.weight.copy_(w)
        fresh.bias.copy_(layer.bias)
    fresh.set_backend("onednn", native=True)
    torch.testing.assert_close(fresh(x), x @ w.T + fresh.bias, rtol=1e-5, atol=1e-5)
    assert isinstance(fresh.impl, DenseLinear) and fresh.impl.native


def test_int8_layer_keeps_only_the_tiles_and_takes_every_row_count_natively() -> None:
    """With the native kernels built, an int8 layer holds its weight once (the tiles, beside row sums and
    scales), runs every row count through the native kernel with native decode on or off, bit for bit the
    reference, and never reads the fp32 weight after quantizing it (a loader may free it)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    layer = Linear(75, 21, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(21, 75, generator=g))
        layer.bias.copy_(torch.randn(21, generator=g))
    ref_weight = quantize_int8(layer.weight, layer.bias)
    layer.set_backend("int8")
    impl = layer.impl
    assert isinstance(impl, Int8Linear) and impl.quantized is None and impl.tiles is not None
    (tiles,) = impl.tensors()
    assert tiles is impl.tiles.tiles and tiles.dtype == torch.int8 and tiles.shape == (3, 2, 8, 64)
    assert layer.released  # the fp32 weight is gone: the tiles are all the layer reads
    for on in (True, False):
        layer.set_native(on)
        for n in (1, 2, 8, 9, 40):
            x = torch.randn(n, 75, generator=g)
            assert torch.equal(layer(x), int8_linear_ref(x, ref_weight))
    x = torch.randn(2, 3, 75, generator=g)  # leading dims, bf16 activations
    assert torch.equal(layer(x), int8_linear_ref(x.view(6, 75), ref_weight).view(2, 3, 21))
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="input features"):
        layer(torch.randn(2, 74))


def test_int8_layer_falls_back_to_fbgemm_without_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernels do not build, an int8 layer quantizes for fbgemm and keeps no tiles."""
    import recap.model.layers.linear as linear_mod

    monkeypatch.setattr(linear_mod, "linear_rows_available", lambda: False)
    layer = Linear(40, 19, bias=True, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    ref_weight = quantize_int8(layer.weight, layer.bias)
    layer.set_backend("int8")
    impl = layer.impl
    assert isinstance(impl, Int8Linear) and impl.tiles is None and impl.quantized is not None
    assert impl.tensors() == []
    for on in (False, True):
        layer.set_native(on)
        for n in (1, 5, 33):
            x = torch.randn(n, 40)
            assert torch.equal(layer(x), int8_linear(x, ref_weight))
    x, y = torch.zeros(2, 40), torch.zeros(2, 19)
    assert impl.graph_call(x, y, 2, ctypes.c_int(1)) is None  # no native kernel to capture


@pytest.mark.parametrize("backend", ["onednn", "int8"])
def test_rebind_moves_the_native_copies_and_binds_the_kernels_to_them(backend: str) -> None:
    """A backend moving a layer's weight and packed copies (onto huge pages) hands them back through rebind:
    the kernels then read the new memory (the old copies zeroed: a kernel still bound to them would say so)."""
    layer = Linear(48, 20, bias=True, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.set_backend(backend)
    layer.set_native(True)
    x = torch.randn(1, 48)
    before = layer(x)
    assert layer.released  # the layout is the only copy: rebind moves all there is
    old = layer.impl.tensors()
    new = [t.clone() for t in old]
    layer.impl.rebind(new)
    for t in old:
        t.zero_()
    assert all(a is b for a, b in zip(layer.impl.tensors(), new, strict=True))
    assert torch.equal(layer(x), before)
    with pytest.raises(ValueError, match="shapes"):
        layer.impl.rebind([t.flatten() for t in new])


@pytest.mark.parametrize(("rows", "d"), [(1, 1), (1, 768), (3, 17), (8, 100), (64, 33), (5, 1024), (300, 1000)])
def test_rms_norm_rows_matches_reference(rows: int, d: int) -> None:
    if not rms_norm_available():
        pytest.skip("the native kernels cannot be built here")
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, w = torch.randn(rows, d, generator=g) * 3, torch.randn(d, generator=g)
    assert use_rms_norm_rows(x, w) and not use_rms_norm_rows(x.double(), w.double())
    y = rms_norm_rows(x, w, 1e-5)
    torch.testing.assert_close(y, rms_norm_rows_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.view(1, rows, d), rms_norm_rows(x.view(1, rows, d), w, 1e-5))  # any leading dims
    for r in sorted({0, rows // 2, rows - 1}):  # batch-invariant: a row alone gives the same bits (caching on = off)
        assert torch.equal(rms_norm_rows(x[r : r + 1].clone(), w, 1e-5)[0], y[r])
