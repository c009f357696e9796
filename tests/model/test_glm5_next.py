"""GLM-5.3-Flash's checkpoint handling: the translator's reading of the nested text config (indexed layers,
shared selections, hyper-connections, tied head), the refused variants, and a hub-like checkpoint that also
stores a vision tower and an MTP layer loading text-only (those weights skipped and counted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.hf_config import translate_config
from recap.model.loader import load_model
from recap.model.testing import tiny_hf_config
from recap.model.translators.common import UnsupportedArchitectureError


def _config(**text: object) -> dict:
    return tiny_hf_config("glm5_next", text_config=text).to_dict()


def test_translator_reads_the_text_config() -> None:
    cfg = translate_config(_config())
    assert cfg.architecture == "Glm5NextForConditionalGeneration"
    assert cfg.layer_types == ("kda", "indexed_attention", "indexed_attention", "kda", "indexed_attention")
    assert cfg.mlp_types == ("dense", "moe", "moe", "dense", "moe") and cfg.shared_index_layers == (2,)
    assert cfg.hyper_connections is not None and cfg.hyper_connections.streams == 3
    assert [n for n, _ in cfg.kv_specs(1)] == ["latent", "index_key", "index_gate"]
    assert [n for n, _ in cfg.kv_specs(2)] == ["latent"]
    assert cfg.kda is not None and cfg.kda.gate_lower_bound == -5.0 and cfg.kda.layout == "glm5"
    assert cfg.moe is not None and cfg.moe.swiglu_limit == 10.0 and cfg.moe.shared_intermediate_size == 32
    tied = tiny_hf_config("glm5_next", tie_word_embeddings=True).to_dict()
    assert translate_config(tied).tie_word_embeddings


REFUSED = [({"qk_rope_head_dim": 8}, "RoPE"), ({"layer_types": ["full_attention", "mamba"] * 2 + ["mamba"]}, "types")]


@pytest.mark.parametrize(("text", "match"), REFUSED)
def test_unsupported_variants_are_refused(text: dict, match: str) -> None:
    raw = _config()
    raw["text_config"].update(text)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        translate_config(raw)


def test_hub_layout_loads_text_only(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("glm5_next"), dst)
    tensors = load_file(dst / "model.safetensors")
    mtp = {"model.language_model.layers.5.eh_proj.weight": torch.zeros(4, 4),
           "model.language_model.layers.5.shared_head.norm.weight": torch.zeros(4)}  # fmt: skip
    save_file({**tensors, **mtp}, dst / "model.safetensors", metadata={"format": "pt"})
    lm = load_model(dst)
    visual = sum(k.startswith("model.visual.") for k in tensors)
    assert visual > 0 and lm.ignored_weights == {"model.visual.": visual}
    assert not any(k.startswith("model.language_model.") for k in lm.model.state_dict())
    assert lm.model.model.layers[1].attn_hc.fn.abs().sum() > 0  # hc_attn_fn loaded into attn_hc.fn
