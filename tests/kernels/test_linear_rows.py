"""The native few-row kernels (kernels/linear_rows.py, kernels/rms_norm.py) against their references, alone and
in a layer."""

from __future__ import annotations

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
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 31, 64, 65, 131])
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
    for backend in ("onednn", "int8"):
        layer.set_backend(backend)
        layer.set_native(True)
        x = torch.randn(3, 24)
        many = layer(x)
        one = torch.cat([layer(x[i : i + 1]) for i in range(3)])
        # rows are independent on both paths (int8: up to fbgemm's rounding of a grid tie, see above)
        tol = 1e-5 if backend == "onednn" else 2e-2
        torch.testing.assert_close(one, many, rtol=tol, atol=tol)
        if backend == "int8":  # 2-8 rows: the native int8 kernel, each row exactly its reference
            for n in (2, 5, 8):
                x = torch.randn(n, 24)
                assert torch.equal(layer(x), int8_linear_ref(x, layer.impl.quantized))
    impl = layer.impl
    assert isinstance(impl, Int8Linear)
    (tiles,) = impl.tensors()
    layer.set_native(False)
    assert impl.tensors()[0] is tiles  # the packed copy is kept while off
    x = torch.randn(1, 24)
    assert torch.equal(layer(x), int8_linear(x, impl.quantized))  # fbgemm again
    layer.set_native(True)
    q = impl.quantized
    torch.testing.assert_close(layer(x), lr.linear_rows_int8(x, tiles, q.row_sums, q.scales, layer.bias,
                                                              q.reduce_range))  # fmt: skip
    with pytest.raises(WeightReleasedError):  # the fp32 weight was freed once quantized
        layer.set_backend("onednn")
    fresh = Linear(24, 10, bias=True, dtype=torch.float32)
    with torch.no_grad():
        fresh.weight.copy_(w)
        fresh.bias.copy_(layer.bias)
    fresh.set_backend("onednn", native=True)
    torch.testing.assert_close(fresh(x), x @ w.T + fresh.bias, rtol=1e-5, atol=1e-5)
    assert isinstance(fresh.impl, DenseLinear) and fresh.impl.native


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


@pytest.mark.parametrize(("rows", "d"), [(1, 1), (1, 768), (3, 17), (8, 100), (64, 33), (5, 1024)])
def test_rms_norm_rows_matches_reference(rows: int, d: int) -> None:
    if not rms_norm_available():
        pytest.skip("the native kernels cannot be built here")
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, w = torch.randn(rows, d, generator=g) * 3, torch.randn(d, generator=g)
    assert use_rms_norm_rows(x, w) and not use_rms_norm_rows(x.double(), w.double())
    y = rms_norm_rows(x, w, 1e-5)
    torch.testing.assert_close(y, rms_norm_rows_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.view(1, rows, d), rms_norm_rows(x.view(1, rows, d), w, 1e-5))  # any leading dims
    assert not use_rms_norm_rows(torch.zeros(65, d), w)  # prefill keeps torch's ops
