"""One copy of each weight: a linear layer in its own layout releases its parameter (layers/linear.py), the
chosen dense layouts compute F.linear, and the loader quantizes each layer as it arrives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recap.backends import CpuBackend, TorchBackend, prepare
from recap.backends.base import model_parts, set_linear_backend
from recap.kernels.linear_rows import linear_rows_available
from recap.model.footprint import held_weight_bytes
from recap.model.layers.embedding import int8_tiles_of
from recap.model.layers.linear import DenseLinear, Int8Linear, Linear, WeightReleasedError, onednn_available
from recap.model.loader import WeightLoadError, load_model
from recap.model.quant import int8_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN not built in")
BF16_ONEDNN = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn_available(torch.bfloat16), reason="oneDNN packs no bf16 weight on this CPU (AVX2 only)"))
needs_int8 = pytest.mark.skipif(not int8_available(), reason="no fbgemm in this torch")


def _layer(out_f: int, in_f: int, bias: bool, dtype: torch.dtype, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_f, out_f, bias, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    return layer


@needs_int8
def test_a_quantized_layer_frees_its_weight_and_says_so_when_asked_for_it() -> None:
    layer = _layer(24, 40, True, torch.float32, 1)
    layer.set_backend("int8")
    assert layer.released and isinstance(layer.impl, Int8Linear) and layer.impl.weight is None
    assert "weight" not in dict(layer.named_parameters())  # not moved, not counted
    assert (layer.in_features, layer.out_features) == (40, 24)  # the shape stays
    with pytest.raises(WeightReleasedError, match="released"):
        _ = layer.weight
    with pytest.raises(WeightReleasedError, match="state dict"):
        layer.state_dict()
    for dense in ("torch", "onednn"):
        with pytest.raises(WeightReleasedError):
            layer.set_backend(dense)
    impl = layer.impl
    layer.set_backend("int8", native=linear_rows_available())
    assert layer.impl is impl  # already int8: not quantized again
    assert layer(torch.randn(3, 40)).shape == (3, 24)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, BF16_ONEDNN])
def test_a_dense_layout_is_the_only_copy_and_gives_the_weight_back_exactly(dtype: torch.dtype) -> None:
    layer = _layer(70, 45, True, dtype, 2)
    w = layer.weight.detach().clone()
    natives = [False, True] if linear_rows_available() else [False]
    for native in natives:
        layer.set_backend("onednn", native=native)
        assert layer.released and layer.impl.weight is None
        with pytest.raises(WeightReleasedError):
            layer.state_dict()
        layer.set_backend("torch")  # back from the panels or oneDNN's copy: the same bits
        assert not layer.released and torch.equal(layer.weight, w) and layer.backend == "torch"
    layer.set_backend("onednn", native=False)
    layer.set_backend("torch", native=False)
    assert held_weight_bytes(layer).linear_copies == 0 and not layer.released  # the reference: its parameter only


@needs_onednn
def test_a_weight_its_owner_reads_is_never_released_nor_copied() -> None:
    layer = Linear(16, 12, False, torch.float32, reads_weight=True)
    with torch.no_grad():
        layer.weight.normal_()
    for backend in ("onednn", *(("int8",) if int8_available() else ())):
        layer.set_backend(backend, native=linear_rows_available())
        assert not layer.released and layer.backend == "torch" and held_weight_bytes(layer).linear_copies == 0


# Odd shapes (out not a multiple of the 32-column panels), rows across one-row, decode and prefill sizes.
SHAPES = [(1, 1), (33, 17), (70, 129), (257, 64)]
ROWS = [1, 2, 7, 8, 33, 64, 65, 200]


@needs_onednn
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize(("dtype", "native"), [(torch.float32, True), (torch.float32, False),
                                               pytest.param(torch.bfloat16, False, marks=BF16_ONEDNN.marks)])
def test_the_dense_layout_matches_f_linear(out_f: int, in_f: int, dtype: torch.dtype, native: bool) -> None:
    """The one layout of "onednn" (fp32 + native kernels: the panels for every row count; otherwise oneDNN's
    packed copy) beside F.linear, the reference, on fresh random inputs."""
    if native and not linear_rows_available():
        pytest.skip("the native kernels cannot be built here")
    seed = torch.seed() % 2**31
    layer = _layer(out_f, in_f, (out_f + in_f) % 2 == 1, dtype, seed)
    w, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    layer.set_backend("onednn", native=native)
    assert layer.released and len(layer.impl.tensors()) == (1 if native else 0)
    g = torch.Generator().manual_seed(seed + 1)
    for rows in ROWS:
        x = torch.randn(rows, in_f, generator=g).to(dtype)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        y = layer(x)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        # fp32: a sum of in_f products, within (in_f + 2) u sum|x w|; bf16: one bf16 rounding of the output on top
        scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
        u = 2.0**-24 if dtype == torch.float32 else 2.0**-8
        bound = ((in_f + 2) * 2.0**-24 + u) * scale
        err = (y.double() - ref).abs()
        assert (err <= bound + 1e-30).all(), f"{rows} rows: max error {err.max():.3g}, seed {seed}"
    x3 = torch.randn(2, 3, in_f, generator=g).to(dtype)  # any leading dims
    torch.testing.assert_close(layer(x3), layer(x3.reshape(6, in_f)).view(2, 3, out_f), rtol=0, atol=0)


@needs_onednn
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_prepared_model_keeps_one_copy_and_its_tied_embedding(
    quantization: str | None, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Every linear layer of a served model holds only its own layout; the tied head's table is the embedding's
    while the head is dense, and once quantized the embedding holds it as int8 rows (no full-precision table
    left, from the load on; a tied int8 head's tiles are those rows; `int8_embeddings=False` keeps it where the
    backend quantizes); the huge-page move and
    the decode graphs run without the released parameters."""
    if quantization and not int8_available():
        pytest.skip("no fbgemm in this torch")
    path = tiny_checkpoint("mamba")  # tied embeddings; Mamba1's dt_proj is read by its mixer (kept)
    table = load_model(path, linear_backend="torch").model.embedding().weight.detach().clone()
    lm = load_model(path, quantization=quantization)
    assert lm.model.embedding().released == bool(quantization)  # int8 as loaded (model/loader.py)
    backend = prepare(lm)
    model = lm.model
    head, embedding = model.head(), model.embedding()
    assert lm.config.tie_word_embeddings
    if quantization:
        assert head.released and embedding.released and embedding.int8_rows().q.dtype == torch.int8
        if int8_tiles_of(head) is not None:  # a tied int8 head (int4's too): its tiles are the rows, one copy
            assert embedding.shared is head.impl.tiles and not hasattr(embedding, "qweight")
        assert not any(p.dtype == torch.float32 and p.shape == table.shape for p in model.parameters())
        kept = load_model(path, linear_backend="torch").model  # quantized by the backend, not as loaded
        set_linear_backend(model_parts(kept), quantization, native=False, int8_embeddings=False)
        assert kept.head().released and torch.equal(kept.embedding().weight, table)
        rows = torch.tensor([0, 3, table.shape[0] - 1])
        err = (embedding(rows) - table[rows]).abs().max() / table[rows].abs().max()
        assert 0 < err <= 0.5 / 127 + 1e-6  # int8 rows: half a step of each row's scale at most
        with pytest.raises(WeightReleasedError):
            _ = embedding.weight
    else:
        assert head.weight is embedding.weight and not head.released and torch.equal(head.weight, table)
    linears = [m for m in model_parts(model) if isinstance(m, Linear) and m is not head and not m.reads_weight]
    assert linears and all(m.released for m in linears)
    assert isinstance(backend, CpuBackend if linear_rows_available() else TorchBackend)
    from recap.model.testing import greedy_generate

    ids = list(range(5, 17))
    fast = greedy_generate(model, ids, 4, backend=backend)  # graphs and huge pages over released weights
    ref = load_model(path, quantization=quantization, native_decode=False)
    assert greedy_generate(ref.model, ids, 4, backend=prepare(ref)) == fast
    with pytest.raises(WeightReleasedError):
        model.state_dict()
    if quantization:
        with pytest.raises(WeightReleasedError):
            TorchBackend("onednn").prepare(model)  # int8 cannot give fp32 back
    else:
        TorchBackend("torch").prepare(model)  # dense: the weights come back from their layouts, exactly
        assert not any(m.released for m in linears) and isinstance(linears[0].impl, DenseLinear)


@needs_int8
def test_the_loader_quantizes_each_layer_as_it_arrives(tiny_checkpoint: Callable[[str], Path]) -> None:
    lm = load_model(tiny_checkpoint("bamba"), quantization="int8")
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.released and isinstance(m.impl, Int8Linear) for m in linears)
    impls = [m.impl for m in linears]
    prepare(lm)
    assert all(m.impl is impl for m, impl in zip(linears, impls, strict=True))  # prepare did not re-quantize


def test_a_truncated_checkpoint_is_a_load_error(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    import shutil

    src = tiny_checkpoint("mamba2")
    shutil.copytree(src, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match="ends inside"):
        load_model(tmp_path / "m")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightLoadError, match="unreadable header"):
        load_model(tmp_path / "m")
