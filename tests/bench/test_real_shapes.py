"""benchmarks/real_shapes.py: each real shape's config builds on the meta device (no weights), has the parameter
count its docstring states, and reads as the recap family it stands for."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from recap.model.hf_config import translate_config

ROOT = Path(__file__).resolve().parents[2]
# stored parameters (the tied head counted once), as the docstring states them
PARAMS_B = {"granite-h-1b": 1.46, "lfm2-1.2b": 1.17, "granite-h-7b": 6.66, "nemotron-h-8b": 8.10,
            "qwen3_5-0.8b": 0.75}  # fmt: skip


def _module() -> ModuleType:  # benchmarks/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("real_shapes", ROOT / "benchmarks" / "real_shapes.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["real_shapes"] = mod
    spec.loader.exec_module(mod)
    return mod


def _meta_params(cls: type, cfg: object) -> int:
    with torch.device("meta"):
        sd = cls(cfg).state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sum(t.numel() for t in sd.values())


@pytest.mark.parametrize("name", sorted(PARAMS_B))
def test_the_shape_has_its_stated_size(name: str) -> None:
    cls, cfg = _module()._BUILDERS[name]()
    assert _meta_params(cls, cfg) / 1e9 == pytest.approx(PARAMS_B[name], abs=0.01)


def test_qwen3_5_is_the_published_0_8b_text_layout() -> None:
    cls, cfg = _module()._BUILDERS["qwen3_5-0.8b"]()
    mc = translate_config({**cfg.to_dict(), "architectures": [cls.__name__]})
    assert mc.architecture == "Qwen3_5ForCausalLM" and mc.hidden_size == 1024 and mc.vocab_size == 248320
    assert mc.tie_word_embeddings and mc.gdn is not None and mc.gdn.projection == "qwen3_5"
    assert mc.layer_types == ("gdn", "gdn", "gdn", "attention") * 6
    assert (mc.gdn.num_k_heads, mc.gdn.num_v_heads, mc.gdn.head_k_dim, mc.gdn.head_v_dim) == (16, 16, 128, 128)


def test_an_unknown_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape 'qwen3_5-9b'"):
        _module().build_checkpoint("qwen3_5-9b", tmp_path)
