"""Weights moved to transparent huge pages (backends/huge_pages.py, by the CPU backend): the same values, the
model's outputs unchanged, the memory huge-paged where the kernel grants it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap.backends import CpuBackend, TorchBackend, cpu, prepare
from recap.backends.huge_pages import HUGE_PAGE, huge_pages_supported, move_to_huge_pages
from recap.kernels.linear_rows import linear_rows_available
from recap.model.loader import load_model
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
    monkeypatch.setattr(cpu, "HUGE_PAGE_MIN_BYTES", 1024)  # the tiny model's matrices count as large
    path = tiny_checkpoint("bamba")
    eager_lm, moved_lm = load_model(path, native_decode=False), load_model(path)
    eager_backend, backend = prepare(eager_lm), prepare(moved_lm)
    eager, moved = eager_lm.model, moved_lm.model
    assert type(eager_backend) is TorchBackend and eager_backend.cache_zeros() is None
    assert isinstance(backend, CpuBackend) and backend.on_huge_pages and backend.cache_zeros() is not None
    big = [p for p in moved.parameters() if p.nbytes >= 1024]
    assert big and not {p.data_ptr() for p in big} & {p.data_ptr() for p in eager.parameters()}
    panels = [t for m in moved.modules() if hasattr(m, "impl") for t in m.impl.tensors()]
    assert panels and all(t.data_ptr() % 64 == 0 for t in panels)  # the native kernels' copies moved too
    prompt = torch.randint(0, eager.config.vocab_size, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = greedy_generate(eager, prompt, 8, backend=eager_backend)
    # the native kernels, bound again after the move (a Mamba2 step bound before it would read freed memory)
    assert greedy_generate(moved, prompt, 8, backend=backend) == expected
    TorchBackend(moved_lm.linear_backend).prepare(moved)  # torch's kernels on the moved weights: the same arithmetic
    assert greedy_generate(moved, prompt, 8) == expected
