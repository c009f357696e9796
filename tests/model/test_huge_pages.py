"""Weights moved to transparent huge pages (model/huge_pages.py): the same values, the model's outputs
unchanged, the memory huge-paged where the kernel grants it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap.kernels.linear_rows import linear_rows_available
from recap.model.huge_pages import HUGE_PAGE, huge_pages_supported, move_to_huge_pages
from recap.model.loader import load_model
from recap.model.models import base
from recap.model.testing import greedy_generate

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")


def test_copies_keep_values_shapes_and_alignment() -> None:
    ts = [torch.randn(300, 77), torch.randint(-127, 127, (5, 3), dtype=torch.int8), torch.randn(4096, 256)]
    out = move_to_huge_pages(ts)
    assert out is not None
    for t, o in zip(ts, out):
        assert torch.equal(t, o) and o.dtype == t.dtype and o.is_contiguous() and o.data_ptr() % 64 == 0
        assert o.data_ptr() != t.data_ptr()
    assert out[0].data_ptr() % HUGE_PAGE == 0  # the mapping starts at a huge-page boundary
    del ts
    out[2].add_(1)  # the mapping outlives the originals and is writable


def test_a_model_moved_to_huge_pages_generates_the_same_tokens(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not linear_rows_available():
        pytest.skip("the native kernels are unavailable, so nothing is moved")
    monkeypatch.setattr(base, "HUGE_PAGE_MIN_BYTES", 1024)  # the tiny model's matrices count as large
    path = tiny_checkpoint("bamba")
    eager = load_model(path, native_decode=False).model
    moved = load_model(path).model
    assert moved._on_huge_pages and not eager._on_huge_pages
    big = [p for p in moved.parameters() if p.nbytes >= 1024]
    assert big and not {p.data_ptr() for p in big} & {p.data_ptr() for p in eager.parameters()}
    prompt = torch.randint(0, eager.config.vocab_size, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = greedy_generate(eager, prompt, 8)
    # the native kernels, bound again after the move (a Mamba2 step bound before it would read freed memory)
    assert greedy_generate(moved, prompt, 8) == expected
    moved.set_native_decode(False)  # torch's kernels on the moved weights: the very same arithmetic
    assert greedy_generate(moved, prompt, 8) == expected
