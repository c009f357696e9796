"""benchmarks/peers_real.py and peers_llama.py: a shape the vendored llama.cpp converter does not register gets a
"llama.cpp skipped" line in the table (recap's rows unchanged); a registered one is found in either converter
layout (the one-file script or the conversion/ package's name map)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str) -> ModuleType:  # benchmarks/ is scripts, not a package
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def _llama(tmp_path: Path, script: str, name_map: str | None) -> object:
    src = tmp_path / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text(script)
    if name_map is not None:
        (src / "conversion").mkdir()
        (src / "conversion" / "__init__.py").write_text(name_map)
    return _module("peers_llama").LlamaCpp(src, tmp_path / "bin")


def _checkpoint(tmp_path: Path, arch: str) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return tmp_path / "ckpt"


@pytest.mark.parametrize(("script", "name_map"), [
    ('@ModelBase.register("Lfm2ForCausalLM")\nclass LFM2Model: ...\n', None),
    ("from conversion import get_model_class\n", 'TEXT_MODEL_MAP = {\n    "Lfm2ForCausalLM": "lfm2",\n}\n'),
])  # fmt: skip
def test_a_registered_architecture_is_supported(tmp_path: Path, script: str, name_map: str | None) -> None:
    supports = _module("peers_llama").converter_supports
    llama = _llama(tmp_path, script, name_map)
    assert supports(llama, _checkpoint(tmp_path, "Lfm2ForCausalLM")) is None
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    why = supports(llama, tmp_path / "ckpt")
    assert why == "Qwen3_5ForCausalLM is not in llama_cpp_python-9.9.9's convert_hf_to_gguf.py"


def test_the_table_says_llama_cpp_was_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    row = {"model": "qwen3_5-0.8b", "threads": 1, "metric": "decode ms b1", "engine": "recap int4", "median": 20.0,
           "values": [20.0], "peak_rss": 2**30, "load_1min": [1.0], "steady_rss": 2**29}  # fmt: skip
    skipped = {"model": "qwen3_5-0.8b", "engine": "llama.cpp", "skipped": "Qwen3_5ForCausalLM is not in x"}
    _module("peers_real").print_real([row, skipped])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["qwen3_5-0.8b", "1", "decode", "ms", "b1", "recap"]
    assert lines[2] == "qwen3_5-0.8b  llama.cpp skipped: Qwen3_5ForCausalLM is not in x"
