"""The family registry: every entry resolves, and the old registries are views of it."""

from __future__ import annotations

import pytest

from recap.model.config import UnsupportedArchitectureError
from recap.model.families import FAMILIES, MODEL_TYPES, TINY_ARCHS, TRANSLATORS, Family, family
from recap.model.hf_config import architecture_of, translate_config
from recap.model.models import MODEL_CLASSES
from recap.model.models.base import CausalLM
from recap.model.testing import tiny_hf_config


@pytest.mark.parametrize("entry", FAMILIES, ids=lambda f: f.architecture)
def test_every_family_resolves(entry: Family) -> None:
    """Translator callable, model class importable, tiny config builds and
    translates to this architecture, and each model_type names it."""
    assert callable(entry.translator)
    cls = entry.model_class()
    assert issubclass(cls, CausalLM)  # (an alias for another family's class where the layouts agree)
    hf = tiny_hf_config(entry.tiny.name).to_dict()
    hf["architectures"] = [entry.architecture]
    cfg = translate_config(hf)
    assert cfg.architecture == entry.architecture and cfg.num_layers >= 2
    for model_type in entry.model_types:
        assert architecture_of({"model_type": model_type}) == entry.architecture


def test_registries_are_views_of_the_families() -> None:
    archs = [f.architecture for f in FAMILIES]
    assert len(set(archs)) == len(archs)
    assert list(TRANSLATORS) == archs and list(MODEL_CLASSES) == archs and list(TINY_ARCHS.values()) == archs
    assert all(TRANSLATORS[f.architecture] is f.translator for f in FAMILIES)
    assert all(MODEL_CLASSES[f.architecture] is f.model_class() for f in FAMILIES)
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(set(types)) == len(types) and set(MODEL_TYPES) == set(types)
    assert len(TINY_ARCHS) == len(FAMILIES)  # one distinct short name each


def test_aliases_load_as_their_family() -> None:
    """The hub's other names for a layout (Ling 3.0's) resolve to the family and translate as it."""
    entry = family("BailingHybridForCausalLM")
    assert entry.aliases == ("BailingMoeV3ForCausalLM", "BailingMoeV2_5ForCausalLM")
    hf = tiny_hf_config(entry.tiny.name).to_dict()
    for alias in entry.aliases:
        assert family(alias) is entry
        cfg = translate_config({**hf, "architectures": [alias]})
        assert cfg.architecture == entry.architecture and cfg.layer_types == ("kda", "attention") * 2


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM.*supported: .*BambaForCausalLM"):
        family("LlamaForCausalLM")
    with pytest.raises(UnsupportedArchitectureError, match="model_type='llama'"):
        architecture_of({"model_type": "llama"})


def test_the_readme_names_every_supported_architecture() -> None:
    """README's list of supported architectures names every family's architecture and alias (in backquotes)."""
    from pathlib import Path

    from recap.model.families import BY_ARCHITECTURE

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    missing = [name for name in BY_ARCHITECTURE if f"`{name}`" not in readme]
    assert not missing, f"README.md does not name {missing}"
