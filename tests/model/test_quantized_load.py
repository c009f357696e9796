"""Loading a bf16 checkpoint quantized (model/loader.py's QuantizeWhenLoaded): each linear weight and the embedding's
table are read in bf16 (no fp32 copy, no cast buffer) and quantized at once, to exactly the codes of their fp32
values; the embedding is int8 as loaded (a tied head laid out from the table first); the int8 tiles and the int4
packing are made a chunk of rows at a time, equal to the whole-matrix forms; and the load's peak RSS, in a fresh
process, stays within the held model plus one bf16 tensor (a vocabulary-heavy model, as a 7B one's 131072 x 4096
embedding and head are the load's largest tensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.backends import prepare
from recap.kernels import linear_int4 as L
from recap.kernels.linear_rows import linear_rows_available, pack_int8
from recap.kernels.quant_chunks import chunk_rows
from recap.model.layers.embedding import Embedding
from recap.model.layers.int4_linear import INT4_ASYM, INT4_GROUP, Int4Linear
from recap.model.layers.linear import Int8Linear, Linear
from recap.model.loader import load_model
from recap.model.quant import quantize_int8_tiles, quantize_int8_weight, row_sums

needs_native = pytest.mark.skipif(not linear_rows_available(), reason="no C compiler for the native kernels")


def _bf16_checkpoint(path: Path, **config: object) -> Path:
    """A tiny random Mamba2 saved by transformers, its tensors then rewritten in bf16 (as hub checkpoints ship)."""
    from recap.model.testing import make_tiny_checkpoint

    make_tiny_checkpoint("mamba2", path, seed=0, **config)
    file = path / "model.safetensors"
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def bf16_mamba2(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    return {tied: _bf16_checkpoint(tmp_path_factory.mktemp(f"bf16-tied{tied}"), tie_word_embeddings=tied)
            for tied in (True, False)}  # fmt: skip


@needs_native
@pytest.mark.parametrize("tied", [True, False])
def test_bf16_weights_quantize_as_loaded_to_the_codes_of_their_fp32_values(
    tied: bool, bf16_mamba2: dict[bool, Path]
) -> None:
    path = bf16_mamba2[tied]
    stored = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    lm = load_model(path, torch.float32, quantization="int4")
    net = lm.model
    emb = net.embedding()
    assert isinstance(emb, Embedding) and emb.released  # int8 as loaded, before any backend prepared the model
    table = stored["backbone.embeddings.weight"]
    q, scales = quantize_int8_weight(table)
    rows = emb.int8_rows()  # tied: the head's tiles, the same rows and scales (one copy of the matrix)
    assert (emb.shared is not None) == tied and not (tied and hasattr(emb, "qweight"))
    assert torch.equal(rows.lookup_ref(torch.arange(q.shape[0])), q.float() * scales[:, None])
    head = net.head()
    assert isinstance(head.impl, Int8Linear) and head.released  # the tied one too: laid out from the table first
    head_weight = table if tied else stored["lm_head.weight"]
    want = quantize_int8_tiles(head_weight, None)
    assert head.impl.tiles is not None and torch.equal(head.impl.tiles.tiles, want.tiles)
    names = {m: n for n, m in net.named_modules()}
    layers = [m for m in net.modules() if isinstance(m, Linear) and m is not head and not m.reads_weight]
    assert layers
    for m in layers:
        assert isinstance(m.impl, Int4Linear) and m.released
        weight = stored[names[m] + ".weight"]
        assert torch.equal(m.impl.quantized.packed, L.quantize_int4(weight, INT4_GROUP, INT4_ASYM).packed), names[m]
    # every tensor that stays a parameter is in the model's dtype (only what was quantized was read as bf16)
    assert all(p.dtype == torch.float32 for p in net.parameters() if p.is_floating_point())
    prepare(lm)  # the backend keeps what the loader made
    assert net.embedding() is emb and net.head().impl.tiles is not None
    assert (emb.shared is net.head().impl.tiles) if tied else emb.int8_rows().q is rows.q


def test_int8_tiles_a_chunk_of_rows_at_a_time_equal_the_whole_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    for out, k in [(37, 70), (300, 129), (16, 64)]:
        w = torch.randn(out, k, generator=g).to(torch.bfloat16)
        b = torch.randn(out, generator=g)
        q, s = quantize_int8_weight(w.float())
        for chunk in (8, 16, 4096, None):
            t = quantize_int8_tiles(w, b, rows=chunk)
            assert torch.equal(t.tiles, pack_int8(q)) and torch.equal(t.row_sums, row_sums(q))
            assert torch.equal(t.scales, s) and torch.equal(t.bias, b) and t.in_features == k
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_int8_tiles(torch.zeros(16, 64), None, rows=12)


def test_int8_quantization_a_chunk_at_a_time_equals_the_whole_matrix_formula() -> None:
    """Several 1 MiB chunks and a short last one (2700 x 200 fp32: 1310 rows a chunk), a zero row, bf16 input."""
    assert chunk_rows(200, 1) == 1310 and chunk_rows(200, 8) == 1304 and chunk_rows(1 << 20, 16) == 16
    with pytest.raises(ValueError):
        chunk_rows(0, 8)
    w = torch.randn(2700, 200, generator=torch.Generator().manual_seed(2)) * torch.rand(2700, 1) * 3
    w[1500] = 0
    kept = w.clone()
    for weight in (w, w.to(torch.bfloat16)):
        x = weight.float()
        s = x.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q, scales = quantize_int8_weight(weight)
        assert torch.equal(scales, s) and torch.equal(q, (x / s[:, None]).round().clamp(-127, 127).to(torch.int8))
        assert torch.equal(row_sums(q), q.sum(1, dtype=torch.int32))
    assert torch.equal(w, kept)  # the fp32 weight is read, not divided in place


def test_int4_packing_a_chunk_of_rows_at_a_time_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(75, 96, generator=torch.Generator().manual_seed(1))
    for asym, group in [(False, 32), (True, 64)]:
        whole = L.quantize_int4(w, group, asym)
        with monkeypatch.context() as m:
            m.setattr(L, "chunk_rows", lambda k, multiple: multiple)  # one tile of rows a chunk
            chunked = L.quantize_int4(w, group, asym)
        assert torch.equal(chunked.packed, whole.packed)


@needs_native
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_int4_load_peak_is_the_model_plus_one_bf16_tensor(tmp_path: Path) -> None:
    """A bf16 Mamba2 whose 131072 x 256 embedding and untied head are most of it, loaded in int4 (int8 head and
    embedding) and prepared in a fresh process: peak - baseline <= held x 1.15 + one bf16 table + 32 MiB (the
    modules loading imports, ~12 MiB, and a chunk's temporaries). Measured: +143-145 MiB for 66 MiB held (it was
    +153-176 from run to run with 4096-row chunks, whose temporaries the heap kept in pieces); cast to fp32
    on reading, with the table kept in fp32 until prepare, it was +334 (the fp32 table, the fp32 head and its cast
    buffer at once)."""
    path = _bf16_checkpoint(tmp_path / "vocab-heavy", hidden_size=256, num_hidden_layers=2, num_heads=8, head_dim=64,
                            vocab_size=131072, n_groups=1, state_size=16, tie_word_embeddings=False)  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "recap.bench.load_probe", str(path), "float32", "int4"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    table = 131072 * 256 * 2  # bf16 bytes of the embedding (and of the head)
    peak, steady = m["peak"] - m["baseline_peak"], m["rss"] - m["baseline_rss"]
    mib = 2**20
    print(f"held {m['held'] / mib:.1f} MiB, peak +{peak / mib:.1f}, steady +{steady / mib:.1f} MiB")
    assert m["held"] < table * 1.2  # int8 embedding and head: half a bf16 table each, and little else
    assert peak <= m["held"] * 1.15 + table + (32 << 20), f"peak +{peak / mib:.0f} MiB, held {m['held'] / mib:.0f}"
    assert steady <= m["held"] * 1.15 + (16 << 20), f"steady +{steady / mib:.0f} MiB, held {m['held'] / mib:.0f}"
