"""Loading the hub's layouts of the GDN hybrids: weights the language model does not use (a vision tower, an
MTP head) are skipped by a declared prefix, counted and logged; anything else unexpected is still refused."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.loader import WeightLoadError, load_model


def _with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vision_language_checkpoint_loads_text_only(arch, tiny_checkpoint, tmp_path, caplog) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint(arch), tmp_path / "ckpt", {"mtp.fc.weight": torch.zeros(4, 4)})
    with caplog.at_level(logging.INFO, logger="recap.model.loader"):
        lm = load_model(path)
    keys = load_file(path / "model.safetensors").keys()
    visual = sum(k.startswith("model.visual.") for k in keys)
    assert visual > 0 and lm.ignored_weights == {"model.visual.": visual, "mtp.": 1}
    assert any("model.visual." in r.getMessage() and str(visual) in r.getMessage() for r in caplog.records)
    assert not any(k.startswith("model.language_model.") for k in lm.model.state_dict())


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "olmo_hybrid"])
def test_an_undeclared_extra_weight_is_still_refused(arch, tiny_checkpoint, tmp_path) -> None:  # noqa: ANN001
    path = _with_extra(tiny_checkpoint(arch), tmp_path / "ckpt", {"model.audio.proj.weight": torch.zeros(2, 2)})
    with pytest.raises(WeightLoadError, match="model.audio.proj.weight"):
        load_model(path)
