"""Importance matrices: `recap imatrix`'s statistics (model/activation_stats.py) against a direct computation on a
tiny checkpoint, and their use at load (model/importance.py): a uniform matrix changes no weight, a skewed one
changes the fits, a file that does not fit the model is refused naming the layer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from recap.cli import main as cli_main
from recap.engine.config import EngineConfig
from recap.model import activation_stats as AS
from recap.model.importance import FLOOR, FORMAT, ImportanceMatrixError, layer_importance
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.moe import ExpertList
from recap.model.loader import load_model
from recap.model.trained_default import draft_model_path


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_stats_equal_a_direct_computation(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Jamba (Mamba, attention, per-expert MoE): the head's row is the mean square of the final hidden rows of
    both chunks, the first mixer's the mean square of its normed embeddings; every dense layer counts every token;
    each MoE layer's experts together count top_k rows a token, and their sums add up to top_k times the router's
    (every expert's input is the router's)."""
    lm = load_model(tiny_checkpoint("jamba"), linear_backend="torch")
    net, cfg = lm.model, lm.config
    chunks = [_ids(37, cfg.vocab_size, 1), _ids(21, cfg.vocab_size, 2)]
    stats = AS.collect(net, chunks)
    means = stats.means()
    with torch.inference_mode():
        hidden = torch.cat([AS.prefill(net, c) for c in chunks])
        normed = torch.cat([net.blocks()[0].input_layernorm(net.embed(torch.tensor(c))) for c in chunks])
    torch.testing.assert_close(means["lm_head.weight"], hidden.double().square().mean(0).float())
    torch.testing.assert_close(means["model.layers.0.mamba.in_proj.weight"], normed.double().square().mean(0).float())
    assert stats.tokens == 58 and stats.chunks == 2 and stats.counts["model.layers.0.mamba.in_proj.weight"] == 58
    moes = [(n, m) for n, m in net.named_modules() if isinstance(m, ExpertList)]
    assert moes
    for name, experts in moes:
        moe = name.removesuffix(".experts")
        router = next(k for k in stats.counts if k.startswith(moe + ".") and "experts" not in k)
        rows = [f"{name}.{e}.up_proj.weight" for e in range(len(experts))]
        assert sum(stats.counts.get(r, 0) for r in rows) == experts.cfg.top_k * 58
        total = sum(stats.sums[r] for r in rows if r in stats.sums)
        torch.testing.assert_close(total, experts.cfg.top_k * stats.sums[router])


def _write(path: Path, rows: dict[str, torch.Tensor]) -> Path:
    save_file(rows, str(path), metadata={"format": FORMAT, "counts": "{}"})
    return path


def _int4(lm_model: torch.nn.Module) -> dict[str, Int4Linear]:
    return {n: m.impl for n, m in AS.linear_layers(lm_model).items() if isinstance(m.impl, Int4Linear)}


@pytest.mark.parametrize("quantization", ["int4", "int4_k"])
def test_uniform_matrix_loads_the_plain_fit_and_a_skewed_one_another(
    quantization: str, tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:  # fmt: skip
    path = tiny_checkpoint("mamba2")
    plain = _int4(load_model(path, quantization=quantization).model)
    layers = AS.linear_layers(load_model(path).model)
    uniform = _write(tmp_path / "u.safetensors", {n: torch.full((m.in_features,), 3.7) for n, m in layers.items()})
    same = _int4(load_model(path, quantization=quantization, quantization_imatrix=uniform).model)
    assert same.keys() == plain.keys() and plain
    assert all(torch.equal(same[n].quantized.packed, plain[n].quantized.packed) for n in plain)
    g = torch.Generator().manual_seed(0)
    skew = {n: torch.exp(torch.randn(m.in_features, generator=g) * 2) for n, m in layers.items()}
    skewed = _write(tmp_path / "s.st", skew)
    fitted = _int4(load_model(path, quantization=quantization, quantization_imatrix=skewed).model)
    assert all(not torch.equal(fitted[n].quantized.packed, plain[n].quantized.packed) for n in plain)


def test_the_fit_gets_the_square_root_of_the_row_over_its_maximum(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:  # fmt: skip
    """The softened weighting (model/importance.py): sqrt(max(row / max, FLOOR)); a row of zeros is left out."""
    net = load_model(tiny_checkpoint("mamba2")).model
    layers = AS.linear_layers(net)
    (name, layer), (zname, zlayer) = list(layers.items())[:2]
    row = torch.rand(layer.in_features, generator=torch.Generator().manual_seed(1)) * 8
    row[0] = 0  # a channel no token reached: the floor
    got = layer_importance(net, _write(tmp_path / "r.st", {name: row, zname: torch.zeros(zlayer.in_features)}), "int4")
    assert list(got) == [layer]
    assert torch.equal(got[layer], torch.clamp_min(row / row.max(), FLOOR).sqrt())
    assert float(got[layer][0]) == pytest.approx(FLOOR**0.5) and float(got[layer].max()) == 1.0


def test_a_file_that_does_not_fit_is_refused_naming_the_layer(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    path = tiny_checkpoint("mamba2")
    layers = AS.linear_layers(load_model(path).model)
    name, layer = next(iter(layers.items()))
    bad = _write(tmp_path / "n.st", {"backbone.layers.0.mixer.nope.weight": torch.ones(4)})
    with pytest.raises(ImportanceMatrixError, match="nope.weight"):
        load_model(path, quantization="int4", quantization_imatrix=bad)
    wide = _write(tmp_path / "w.st", {name: torch.ones(layer.in_features + 1)})
    with pytest.raises(ImportanceMatrixError, match=f"{name}.*{layer.in_features + 1} channels"):
        load_model(path, quantization="int4", quantization_imatrix=wide)
    one = _write(tmp_path / "o.st", {name: torch.rand(layer.in_features) + 0.1})
    with pytest.raises(ImportanceMatrixError, match="int4 fits"):
        load_model(path, quantization="int8", quantization_imatrix=one)
    with pytest.raises(ValueError, match="quantization_imatrix"):
        EngineConfig(quantization="int8", quantization_imatrix=str(one))
    with caplog.at_level(logging.INFO, logger="recap.model.importance"):
        lm = load_model(path, quantization="int4", quantization_imatrix=one)
    n_int4 = len(_int4(lm.model))
    assert f"1 int4 layers fitted with it, {n_int4 - 1} without" in caplog.text


def test_cli_writes_the_file_the_loader_reads(tmp_path: Path) -> None:
    """On the shipped draft model (a tokenizer: the tiny checkpoints have none)."""
    path = draft_model_path()
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "m.safetensors"
    assert cli_main(["imatrix", str(path), "--data", str(text), "--out", str(out), "--ctx", "32", "--chunks", "3"]) == 0
    with safe_open(str(out), framework="pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["format"] == FORMAT and meta["tokens"] == "96" and meta["chunks"] == "3"
    assert keys == set(AS.linear_layers(load_model(path).model))
    lm = load_model(path, quantization="int4", quantization_imatrix=out)
    assert _int4(lm.model)
