"""Kernel-specific checks: independent oracles (F.conv1d, a naive segsum), the Mamba1 scan's two block
paths, long rows over many chunks, optional arguments and dt_limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.conv1d import causal_conv1d
from recap.kernels.selective_scan import LOG_RANGE, scan_block, selective_scan, selective_scan_ref
from recap.kernels.ssd import segsum, ssd, ssd_ref

from .cases import Row, assert_close, build_meta


def _one_row_meta(n: int, ctx: int = 0, chunk: int = 16, cps: list[tuple[int, int]] | None = None):
    return build_meta([Row({"x": torch.zeros(n)}, ctx, 1, cps or [])], chunk)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv1d_matches_torch_conv1d(activation: str | None) -> None:
    gen = torch.Generator().manual_seed(0)
    n, d, k = 29, 7, 4
    x, w, b = torch.randn(n, d, generator=gen), torch.randn(d, k, generator=gen), torch.randn(d, generator=gen)
    cache = torch.randn(3, d, k - 1, generator=gen)
    y = causal_conv1d(x, w, b, cache, _one_row_meta(n, chunk=8), activation)
    expected = F.conv1d(x.T[None], w[:, None, :], b, padding=k - 1, groups=d)[0, :, :n].T
    assert_close(y, expected if activation is None else F.silu(expected))
    assert torch.equal(cache[1], x[-(k - 1) :].T)  # the window is the last K-1 inputs, oldest first


def test_conv1d_checkpoint_window_reaches_into_initial_state() -> None:
    d, k = 3, 4
    x = torch.arange(2 * d, dtype=torch.float32).view(2, d) + 100
    cache = torch.arange(4 * d * (k - 1), dtype=torch.float32).view(4, d, k - 1)
    init = cache[1].clone()
    causal_conv1d(x, torch.ones(d, k), None, cache, _one_row_meta(2, ctx=10, cps=[(11, 3)]))
    assert torch.equal(cache[3], torch.cat([init[:, 1:], x[:1].T], dim=1))  # after 1 token
    assert torch.equal(cache[1], torch.cat([init[:, 2:], x.T], dim=1))  # after 2 tokens


def _sequential(a: torch.Tensor, bx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    out = []
    for t in range(a.shape[1]):
        h = torch.exp(a[:, t]) * h + bx[:, t]
        out.append(h)
    return torch.stack(out, 1)


@pytest.mark.parametrize("decay", [0.05, 4.0, 80.0], ids=["log-space", "split-halves", "log-depth"])
def test_scan_block_paths_match_sequential(decay: float) -> None:
    gen = torch.Generator().manual_seed(1)
    dl = torch.rand(3, 32, 6, generator=gen)
    A = -torch.rand(6, 4, generator=gen) * decay
    bx, h0 = torch.randn(3, 32, 6, 4, generator=gen), torch.randn(3, 6, 4, generator=gen)
    range_ = float(dl.sum(1).max() * A.abs().max())
    assert (range_ < LOG_RANGE) == (decay < 1)
    expected = _sequential(dl[..., None] * A, bx, h0)
    assert_close(scan_block(dl, A, bx.clone(), h0), expected)


@pytest.mark.parametrize("options", ["all", "bare"])
def test_selective_scan_long_row_strong_decay(options: str) -> None:
    """300 tokens over many blocks, some channels decaying fast enough to take the fallback path."""
    gen = torch.Generator().manual_seed(2)
    t, i, n = 300, 8, 4
    u, dt, z = (torch.randn(t, i, generator=gen) for _ in range(3))
    B, C = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    A = -torch.rand(i, n, generator=gen) * 4
    A[0] = -80.0
    D, bias = torch.randn(i, generator=gen), torch.randn(i, generator=gen)
    bare = options == "bare"
    args = (u, dt.abs() if bare else dt, A, B, C, None if bare else D, None if bare else z, None if bare else bias)
    meta = build_meta([Row({"x": torch.zeros(t)}, 7, 1, [(40, 2), (171, 3)])], 64)
    cache, cache_ref = torch.randn(4, i, n, generator=gen), None
    cache_ref = cache.clone()
    y = selective_scan(*args, not bare, cache, meta)
    y_ref = selective_scan_ref(*args, not bare, cache_ref, meta)
    assert_close(y, y_ref)
    assert_close(cache, cache_ref)


def test_segsum_matches_naive() -> None:
    x = torch.randn(2, 3, 7)
    seg = segsum(x)
    for i in range(7):
        for j in range(7):
            expected = x[..., j + 1 : i + 1].sum(-1) if i >= j else torch.full_like(x[..., 0], -torch.inf)
            assert_close(seg[..., i, j], expected)


@pytest.mark.parametrize(
    ("groups", "with_d", "limit", "sub"), [(1, True, (0.0, float("inf")), 64), (4, False, (0.05, 0.5), 24)]
)
def test_ssd_long_rows_many_chunks(groups: int, with_d: bool, limit: tuple[float, float], sub: int) -> None:
    """Two long rows and a padding row, metadata chunks of 128 cut into sub-chunks; dt_limit clamps; G = 1 and H."""
    gen = torch.Generator().manual_seed(3)
    h, p, n = 4, 5, 6
    lens = [150, 3, 211]
    t = sum(lens)
    x, dt = torch.randn(t, h, p, generator=gen), torch.randn(t, h, generator=gen) * 2
    B, C = torch.randn(t, groups, n, generator=gen), torch.randn(t, groups, n, generator=gen)
    A, D, bias = -torch.rand(h, generator=gen) * 2, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    rows = [
        Row({"x": torch.zeros(lens[0])}, 0, 1, [(64, 5), (100, 6)]),
        Row({"x": torch.zeros(lens[1])}, 0, PAD_SLOT_ID, padding=True),
        Row({"x": torch.zeros(lens[2])}, 33, 2, [(34, 7), (244, 8)]),
    ]
    meta = build_meta(rows, 128)
    cache = torch.randn(10, h, p, n, generator=gen)
    before, cache_ref = cache.clone(), cache.clone()
    args = (x, dt, A, B, C, D if with_d else None, bias, True, limit)
    y = ssd(*args, cache, meta, sub_chunk=sub)
    y_ref = ssd_ref(*args, cache_ref, meta)
    assert_close(y, y_ref, tol=5e-5)
    assert_close(cache, cache_ref, tol=5e-5)
    assert torch.equal(cache[[0, 3, 4, 9]], before[[0, 3, 4, 9]])
    if limit[1] < 1:  # the clamp matters: unclamped dt would give another result
        other = ssd_ref(x, dt, A, B, C, None, bias, True, (0.0, float("inf")), before.clone(), meta)
        assert not torch.allclose(other, y_ref, atol=1e-3)


@pytest.mark.parametrize(
    "decay", [(0.5, 1.0, 2.0), (0.05, 3.0, 60.0), (40.0, 50.0, 60.0)], ids=["mild", "mixed", "strong"]
)
def test_ssd_equal_chunks_view_path_and_strong_decay(decay: tuple[float, float, float]) -> None:
    """Every sub-chunk exactly full (the kernel's no-gather path), G = 1. Heads whose chunks decay more than
    FACTOR_SPAN take the exact intra-chunk form, the others the factorized one (mixed: both in one step);
    strong decay drives exp(segsum) far below the fp32 normal range, where the kernel clamps."""
    gen = torch.Generator().manual_seed(4)
    t, h, p, n = 96, 3, 4, 5
    x, dt = torch.randn(t, h, p, generator=gen), torch.randn(t, h, generator=gen) + 1
    B, C = torch.randn(t, 1, n, generator=gen), torch.randn(t, 1, n, generator=gen)
    A, D, bias = -torch.tensor(decay), torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    meta = build_meta([Row({"x": torch.zeros(t)}, 64, 1, [(80, 2), (128, 3)])], 32)  # chunks of 16 at sub 16
    cache = torch.randn(4, h, p, n, generator=gen)
    cache_ref = cache.clone()
    args = (x, dt, A, B, C, D, bias, True, (0.0, float("inf")))
    y = ssd(*args, cache, meta, sub_chunk=16)
    y_ref = ssd_ref(*args, cache_ref, meta)
    assert y.isfinite().all()
    assert_close(y, y_ref)
    assert_close(cache, cache_ref)
