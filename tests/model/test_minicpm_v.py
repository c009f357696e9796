"""MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR loaded text-only: the vision tower and merger skipped by name and counted,
anything else unexpected refused, the text model equal to the checkpoint's `model.language_model` (and `lm_head`,
unless tied), the outer tie flag governing the head (logits and greedy tokens against transformers:
test_hf_parity)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.config import UnsupportedArchitectureError
from recap.model.hf_config import read_hf_config, translate_config
from recap.model.loader import WeightLoadError, load_model

ARCHS = ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr")


def _with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_towers_are_skipped_by_name_and_the_text_model_is_the_language_model(arch, tiny_checkpoint) -> None:  # noqa: ANN001
    path = tiny_checkpoint(arch)
    lm = load_model(path)
    stored = load_file(path / "model.safetensors")
    towers = {p: sum(k.startswith(p) for k in stored) for p in ("model.vision_tower.", "model.merger.")}
    assert all(n > 0 for n in towers.values()) and lm.ignored_weights == towers
    text = {"model." + k.removeprefix("model.language_model."): v for k, v in stored.items()
            if k.startswith("model.language_model.")}  # fmt: skip
    assert ("lm_head.weight" in stored) == (arch != "minicpm_ocr")  # OCR ties its head: save_pretrained drops it
    text |= {k: v for k, v in stored.items() if k == "lm_head.weight"}
    state = lm.model.state_dict()
    assert set(state) == set(text) and all(torch.equal(state[k], v) for k, v in text.items())
    assert lm.config.tie_word_embeddings == (arch == "minicpm_ocr")


@pytest.mark.parametrize("extra", ["model.resampler.proj", "vpm.encoder.layers.0.mlp.fc1.weight",
                                   "model.layers.0.input_layernorm.weight", "model.language_model.merger.x"])
def test_an_undeclared_weight_is_refused(extra, tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint("minicpmv4_6"), tmp_path / "ckpt", {extra: torch.ones(64)})
    with pytest.raises(WeightLoadError, match=f"unexpected key '{re.escape(extra)}'"):
        load_model(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_is_its_qwen3_5_text_config(arch, tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = read_hf_config(tiny_checkpoint(arch))
    ref = translate_config(cfg)
    text = translate_config({**cfg["text_config"], "architectures": ["Qwen3_5ForCausalLM"],
                             "tie_word_embeddings": ref.tie_word_embeddings})  # fmt: skip
    assert ref.architecture == cfg["architectures"][0] and ref.layer_types == text.layer_types
    assert ref.gdn == text.gdn and ref.attention == text.attention and ref.mlp == text.mlp
    # a config.json without the outer flag: its class's default (transformers'), not the text config's
    untied = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    untied["text_config"] = {**cfg["text_config"], "tie_word_embeddings": arch != "minicpm_ocr"}
    assert translate_config(untied).tie_word_embeddings == (arch == "minicpm_ocr")
    other = {**cfg, "text_config": {**cfg["text_config"], "model_type": "qwen3_5_moe_text"}}
    with pytest.raises(UnsupportedArchitectureError, match="text model 'qwen3_5_moe_text' is not supported"):
        translate_config(other)
    with pytest.raises(ValueError, match="config.json has no text_config"):
        translate_config({k: v for k, v in cfg.items() if k != "text_config"})


def test_a_kept_mtp_head_is_skipped_like_qwen3_5s(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint("minicpmv4_6"), tmp_path / "ckpt", {"mtp.fc.weight": torch.ones(64)})
    assert load_model(path).ignored_weights["mtp."] == 1
