"""The default tokenizer, trained once per process and copied into each tiny test checkpoint that needs one.

Training the byte-level BPE takes 0.5-1 s on the shared CI box and the suites write it into over a hundred tiny
folders. Training is deterministic (the same seed and vocab size give the same files, byte for byte:
tests/test_tiny_tokenizer.py), so a copy of the first training's files is that tokenizer.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from recap.model.default_model import SEED, VOCAB_SIZE, save_tokenizer


@functools.cache
def _trained(seed: int, vocab_size: int) -> tuple[tuple[str, bytes], ...]:
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(Path(tmp), seed=seed, vocab_size=vocab_size)
        return tuple((p.name, p.read_bytes()) for p in sorted(Path(tmp).iterdir()))


def save_tiny_tokenizer(folder: Path, seed: int = SEED, vocab_size: int = VOCAB_SIZE) -> None:
    """What `save_tokenizer(folder, seed, vocab_size)` writes, from this process's one training of it."""
    for name, data in _trained(seed, vocab_size):
        (folder / name).write_bytes(data)
