"""load_tokenizer's shortcut for the shipped default models (TokenizersBackend directly) gives what
AutoTokenizer gives, and skips AutoTokenizer's import (a scan of every transformers model folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recap.model.loader import bundled_tokenizers_backend, load_tokenizer, load_tokenizer_auto
from recap.model.trained_default import default_model_path, draft_model_path

TEXTS = ["Call me Ishmael.", " <|im_start|>user\nHi<|im_end|>", "naïve café 12345 \t\n  spaces", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And?"}]  # fmt: skip


@pytest.mark.parametrize("folder", [default_model_path(), draft_model_path()], ids=["main", "draft"])
def test_bundled_tokenizer_equals_auto_tokenizer(folder: Path) -> None:
    assert bundled_tokenizers_backend(folder)
    fast, ref = load_tokenizer(folder), load_tokenizer_auto(folder)
    assert type(fast) is type(ref)
    assert vars(fast).keys() == vars(ref).keys()
    for key, value in vars(ref).items():  # every setting (special tokens, init kwargs, template, max length)
        assert repr(vars(fast)[key]) == repr(value), key
    assert fast.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    for text in TEXTS:
        assert fast.encode(text) == ref.encode(text)
        assert fast.decode(fast.encode(text)) == ref.decode(ref.encode(text))
    for gen in (False, True):
        assert fast.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False) == \
            ref.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)  # fmt: skip


def test_other_folders_go_through_auto_tokenizer(tmp_path: Path) -> None:
    copy = tmp_path / "default"  # the same files outside recap/model/weights/
    shutil.copytree(default_model_path(), copy, ignore=shutil.ignore_patterns("*.safetensors"))
    assert not bundled_tokenizers_backend(copy)
    weights = default_model_path().parent
    assert not bundled_tokenizers_backend(weights)  # the weights folder itself is no model


def test_bundled_folder_with_other_class_goes_through_auto_tokenizer(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import recap.model.loader as loader

    folder = tmp_path / "default"
    folder.mkdir()
    cfg = json.loads((default_model_path() / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    monkeypatch.setattr(loader, "WEIGHTS_DIR", tmp_path)
    assert not loader.bundled_tokenizers_backend(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert loader.bundled_tokenizers_backend(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["x", None]}}))
    assert not loader.bundled_tokenizers_backend(folder)


def test_default_tokenizer_skips_auto_tokenizer_import() -> None:
    code = ("import sys\nfrom recap.model.loader import load_tokenizer\n"
            "from recap.model.trained_default import default_model_path\n"
            "load_tokenizer(default_model_path())\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))")  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
