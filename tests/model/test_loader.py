"""Strict loading: typed errors naming the key, sharded checkpoints, tied embeddings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.config import UnsupportedArchitectureError
from recap.model.layers.linear import Linear, onednn_available
from recap.model.loader import WeightLoadError, load_model


def _rewrite(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    """Copy a checkpoint folder, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(src / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_key(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    key = "model.layers.1.self_attn.k_proj.weight"
    path = _rewrite(tiny_checkpoint("bamba"), tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(WeightLoadError, match="missing key") as e:
        load_model(path)
    assert key in str(e.value)


def test_missing_untied_lm_head(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _rewrite(
        tiny_checkpoint("mamba2"), tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}
    )
    with pytest.raises(WeightLoadError, match="lm_head.weight"):
        load_model(path)


def test_unexpected_key(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    key = "model.layers.0.mamba.extra_bias"
    path = _rewrite(tiny_checkpoint("bamba"), tmp_path / "m", lambda t: {**t, key: torch.zeros(3)})
    with pytest.raises(WeightLoadError, match="unexpected key") as e:
        load_model(path)
    assert key in str(e.value)


def test_shape_mismatch(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    key = "model.layers.1.feed_forward.experts.2.up_proj.weight"  # Jamba's per-expert layout on disk
    path = _rewrite(tiny_checkpoint("jamba"), tmp_path / "m", lambda t: {**t, key: t[key][:-1].clone()})
    with pytest.raises(WeightLoadError, match="shape mismatch") as e:
        load_model(path)
    assert key in str(e.value) and "(127, 64)" in str(e.value)


def test_unknown_architecture(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("mamba"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM") as e:
        load_model(path)
    assert "MambaForCausalLM" in str(e.value)


def test_no_weights_file(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny_checkpoint("mamba") / "config.json", path)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load_model(path)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "does-not-exist")


def test_sharded_index_loads_same_weights(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint("jamba")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, sharded = load_model(src).model.state_dict(), load_model(tmp_path / "sharded").model.state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_tied_embeddings(tiny_checkpoint, tiny_model, tmp_path) -> None:  # noqa: ANN001
    lm = load_model(tiny_checkpoint("mamba"))
    assert lm.config.tie_word_embeddings
    assert "lm_head.weight" not in lm.model.state_dict()
    assert lm.model.head().weight is lm.model.embedding().weight
    prepared = tiny_model("mamba").model  # prepared to serve: the tied head's table is the embedding's, kept
    assert prepared.head().weight is prepared.embedding().weight and not prepared.head().released
    # A hub checkpoint that also stores the tied head loads (the copy is ignored).
    path = _rewrite(
        tiny_checkpoint("mamba"),
        tmp_path / "m",
        lambda t: {**t, "lm_head.weight": t["backbone.embeddings.weight"].clone()},
    )
    assert torch.equal(load_model(path).model.head().weight, lm.model.head().weight)


def test_dtype_cast(tiny_checkpoint) -> None:  # noqa: ANN001
    lm = load_model(tiny_checkpoint("mamba2"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())


# On-disk keys of the Mamba2 hybrids (save_pretrained's legacy layout) whose absence must be named.
FAMILY_KEYS = [
    ("nemotron_h", "backbone.layers.1.mixer.experts.3.up_proj.weight"),
    ("nemotron_h", "backbone.layers.1.mixer.gate.e_score_correction_bias"),
    ("granite_hybrid", "model.layers.2.block_sparse_moe.input_linear.weight"),
    ("granite_hybrid", "model.layers.0.shared_mlp.output_linear.weight"),
    ("falcon_h1", "model.layers.2.self_attn.o_proj.weight"),
    ("zamba2", "model.layers.3.shared_transformer.self_attn.linear_q_adapter_list.1.0.weight"),
    ("zamba2", "model.layers.4.linear.weight"),
    ("zamba", "model.layers.3.mamba_decoder.mamba.x_proj_weight"),
    ("zamba", "model.layers.1.shared_transf.feed_forward.gate_proj.weight"),
    ("minimax", "model.layers.2.block_sparse_moe.experts.3.w3.weight"),
    ("minimax", "model.layers.0.self_attn.output_gate.weight"),
    ("recurrent_gemma", "model.layers.1.temporal_block.rg_lru.recurrent_gate_weight"),
    ("recurrent_gemma", "model.layers.2.temporal_block.o_proj.bias"),
]


@pytest.mark.parametrize(("arch", "key"), FAMILY_KEYS)
def test_hybrid_family_keys_are_strict(arch, key, tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    src = tiny_checkpoint(arch)
    assert key in load_file(src / "model.safetensors")
    path = _rewrite(src, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(WeightLoadError, match="missing key") as e:
        load_model(path)
    assert key in str(e.value) or key.rsplit(".", 2)[0] in str(e.value)  # renamed keys are named by layer
    path = _rewrite(src, tmp_path / "shape", lambda t: {**t, key: t[key][..., :-1].clone()})
    with pytest.raises(WeightLoadError, match="shape mismatch") as e:
        load_model(path)
    assert key in str(e.value)


def test_zamba2_shared_block_is_stored_once(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    """A copy of a shared block under a later user is not a weight the model has (transformers writes none)."""
    src = tiny_checkpoint("zamba2")
    extra = "model.layers.4.shared_transformer.self_attn.q_proj.weight"  # layer 4 reuses layer 1's block
    first = "model.layers.1.shared_transformer.self_attn.q_proj.weight"
    path = _rewrite(src, tmp_path / "m", lambda t: {**t, extra: t[first].clone()})
    with pytest.raises(WeightLoadError, match="unexpected key") as e:
        load_model(path)
    assert extra in str(e.value)


def test_zamba_shared_block_is_stored_once(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    """Zamba (v1) as Zamba2: its one shared block lives under the first hybrid layer only."""
    src = tiny_checkpoint("zamba")
    extra = "model.layers.3.shared_transf.self_attn.q_proj.weight"
    first = "model.layers.1.shared_transf.self_attn.q_proj.weight"
    path = _rewrite(src, tmp_path / "m", lambda t: {**t, extra: t[first].clone()})
    with pytest.raises(WeightLoadError, match="unexpected key") as e:
        load_model(path)
    assert extra in str(e.value)


def test_nemotron_h_mtp_weights_are_skipped_by_name(tiny_checkpoint, tiny_model, tmp_path) -> None:  # noqa: ANN001
    mtp = "mtp.layers.0.norm.weight"  # a multi-token-prediction head weight, as Nemotron-3 checkpoints carry
    path = _rewrite(tiny_checkpoint("nemotron_h"), tmp_path / "m", lambda t: {**t, mtp: torch.ones(64)})
    lm = load_model(path)
    ref = load_model(tiny_checkpoint("nemotron_h")).model.state_dict()  # not prepared: its weights all there
    assert all(torch.equal(v, ref[k]) for k, v in lm.model.state_dict().items())


def test_the_execution_flags_are_checked_and_recorded_for_the_backend(tiny_checkpoint) -> None:  # noqa: ANN001
    """load_model leaves the modules on their reference paths and records how they should run."""
    path = tiny_checkpoint("mamba2")
    lm = load_model(path)
    assert lm.linear_backend == ("onednn" if onednn_available() else "torch") and lm.native_decode
    assert all(m.backend == "torch" and not m.impl.native for m in lm.model.modules() if isinstance(m, Linear))
    lm = load_model(path, quantization="int8", native_decode=False)
    assert (lm.linear_backend, lm.native_decode) == ("int8", False)
    assert load_model(path, quantization="int4").linear_backend == "int4"
    with pytest.raises(ValueError, match="linear backend"):
        load_model(path, linear_backend="int3")
