"""The tests' copied tokenizer (tests/tiny_tokenizer.py) is the default tokenizer trained afresh, file for file."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap.model.default_model import SEED, save_tokenizer
from tests.tiny_tokenizer import save_tiny_tokenizer


@pytest.mark.parametrize(("seed", "vocab_size"), [(SEED, 512), (0, 300)])
def test_a_copy_equals_a_fresh_training(tmp_path: Path, seed: int, vocab_size: int) -> None:
    fresh, first, copy = tmp_path / "fresh", tmp_path / "first", tmp_path / "copy"
    for folder in (fresh, first, copy):
        folder.mkdir()
    save_tokenizer(fresh, seed=seed, vocab_size=vocab_size)
    save_tiny_tokenizer(first, seed=seed, vocab_size=vocab_size)
    save_tiny_tokenizer(copy, seed=seed, vocab_size=vocab_size)  # from the cache
    files = sorted(p.name for p in fresh.iterdir())
    assert files and files == sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in first.iterdir())
    for name in files:
        assert (copy / name).read_bytes() == (fresh / name).read_bytes(), name
