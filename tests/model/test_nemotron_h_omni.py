"""Nemotron-3 Nano Omni (NemotronH_Omni_Reasoning_V3) loaded text-only: its towers skipped by name and counted,
anything else unexpected refused, the text model equal to the checkpoint's `language_model`, and the released
configs' names (`NemotronH_Nano_Omni_Reasoning_V3`, `llm_config`) read as transformers' (logits and greedy tokens
against transformers: test_hf_parity)."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.hf_config import read_hf_config, translate_config
from recap.model.loader import WeightLoadError, load_model

MTP = "language_model.mtp.layers.0.norm.weight"  # a multi-token-prediction weight, as Nemotron-3 checkpoints carry


def _with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_towers_are_skipped_by_name_and_the_text_model_is_the_language_model(tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint("nemotron_h_omni"), tmp_path / "ckpt", {MTP: torch.ones(64)})
    lm = load_model(path)
    stored = load_file(path / "model.safetensors")
    towers = {p: sum(k.startswith(p) for k in stored) for p in ("vision_model.", "mlp1.", "sound_encoder.",
                                                                  "sound_projection.")}  # fmt: skip
    assert all(n > 0 for n in towers.values()) and lm.ignored_weights == {**towers, "language_model.mtp.": 1}
    state = lm.model.state_dict()
    text = {k.removeprefix("language_model."): v for k, v in stored.items() if k.startswith("language_model.")}
    del text["mtp.layers.0.norm.weight"]  # skipped (counted) as NemotronHForCausalLM skips it
    assert set(state) == set(text) and all(torch.equal(state[k], v) for k, v in text.items())


@pytest.mark.parametrize("extra", ["audio_adapter.proj.weight", "backbone.layers.0.norm.weight",
                                   "language_model.vision_model.x"])  # fmt: skip
def test_an_undeclared_weight_is_refused(extra, tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint("nemotron_h_omni"), tmp_path / "ckpt", {extra: torch.ones(64)})
    with pytest.raises(WeightLoadError, match=f"unexpected key '{re.escape(extra)}'"):
        load_model(path)


def test_the_released_configs_names_translate_as_transformers(tiny_checkpoint) -> None:  # noqa: ANN001
    """The hub's config.json (remote code): architecture and model_type NemotronH_Nano_Omni_Reasoning_V3, the text
    model under `llm_config`, the audio under `sound_config`."""
    cfg = read_hf_config(tiny_checkpoint("nemotron_h_omni"))
    ref = translate_config(cfg)
    assert ref.architecture == "NemotronH_Omni_Reasoning_V3" and ref.layer_types[:3] == ("mamba2", "none", "attention")
    released = {k: v for k, v in cfg.items() if k not in ("text_config", "audio_config", "architectures")}
    released |= {"model_type": "NemotronH_Nano_Omni_Reasoning_V3", "llm_config": cfg["text_config"],
                 "sound_config": cfg["audio_config"]}  # fmt: skip
    assert translate_config(released) == ref
    assert translate_config({**released, "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"]}) == ref
    # the outer config's generation ids govern the checkpoint
    assert translate_config({**cfg, "eos_token_id": 7}) == dataclasses.replace(ref, eos_token_id=7)
    with pytest.raises(ValueError, match="NemotronH_Omni_Reasoning_V3: config.json has no text_config"):
        translate_config({k: v for k, v in cfg.items() if k != "text_config"})
