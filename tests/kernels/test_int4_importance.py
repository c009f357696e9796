"""int4 fits weighted by an importance matrix (quantize_int4(importance=...)): the native fits against their
references with importances, a uniform matrix changing nothing, a skewed one lowering the error it weighs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recap.kernels import int4_superblock as SBK
from recap.kernels import linear_int4 as L


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run


def _native() -> None:
    if not L.int4_native_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")


def _groups(g: torch.Generator, n: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n groups of weights with outliers, an all-zero group, and importances spanning 6 decades with zeros."""
    w = torch.randn(n, group, generator=g) * torch.rand(n, 1, generator=g).add(0.01) * 0.1
    w[::7, int(torch.randint(0, group, (1,), generator=g))] *= 40
    w[3] = 0
    imp = torch.exp(torch.randn(n, group, generator=g) * 3).clamp(max=1.0)
    imp[5] = 0  # a group no token reached: the fit falls back on its degenerate choice
    imp[9, ::2] = 0
    return w, imp


@pytest.mark.parametrize("group", [32, 64])
def test_weighted_sym_fit_with_importance_native_equals_ref(group: int) -> None:
    _native()
    g = _gen()
    n = 1000 + int(torch.randint(0, 97, (1,), generator=g))  # vectors of 16 and of 8 groups, then a ragged tail
    w, imp = _groups(g, n, group)
    ref = L.sym_fit_ref(w, imp)
    assert not torch.equal(ref, L.sym_fit_ref(w))  # the importances change the fit
    for isa in L.supported_isas():
        out = L._sym_scales(w.view(1, n, group), "weighted", isa, imp.view(1, n, group))[0]
        assert torch.equal(out, ref), (L.ISAS[isa], (out != ref).nonzero()[:5])


def test_superblock_fit_with_importance_native_equals_ref() -> None:
    _native()
    g = _gen()
    w, imp = _groups(g, 301, SBK.GROUP)  # 18 vectors of 16 groups, 13 one by one
    s_ref, m_ref = SBK.asym_fit_ref(w, imp)
    s, m = SBK.asym_fit(w, imp)
    assert torch.equal(s, s_ref) and torch.equal(m, m_ref)
    assert not torch.equal(s_ref, SBK.asym_fit_ref(w)[0])


@pytest.mark.parametrize(("out_f", "in_f"), [(17, 33), (40, 100), (9, 200), (31, 520)])
def test_quantize_with_importance_equals_the_reference_on_ragged_rows(out_f: int, in_f: int) -> None:
    """quantize_int4(importance=): each group's scale sym_fit_ref's with the row's importances, the zero padding of
    a ragged last group at importance 1."""
    g = _gen()
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    imp = torch.rand(in_f, generator=g) ** 4
    q = L.quantize_int4(w, 32, importance=imp)
    wp = F.pad(w, (0, -in_f % 32)).view(-1, 32)
    ip = F.pad(imp, (0, -in_f % 32), value=1.0).view(1, -1, 32).expand(out_f, -1, -1).reshape(-1, 32)
    s = L.sym_fit_ref(wp, ip).half().float().view(out_f, -1)
    _, scales, _ = L.unpack_int4(q)
    assert torch.equal(scales[:out_f], torch.where(s != 0, s, torch.ones_like(s)))


@pytest.mark.parametrize("superblock", [False, True])
@pytest.mark.parametrize(("out_f", "in_f"), [(17, 45), (40, 300)])
def test_uniform_importance_fits_as_without(superblock: bool, out_f: int, in_f: int) -> None:
    """A matrix equal across channels says nothing: the packed weight is today's, bit for bit (the loader hands
    quantize_int4 the row over its maximum: all ones)."""
    g = _gen()
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    plain = L.quantize_int4(w, 32, superblock=superblock)
    ones = L.quantize_int4(w, 32, superblock=superblock, importance=torch.ones(in_f))
    assert torch.equal(plain.packed, ones.packed)


def _weighted_error(q: L.Int4Weight, w: torch.Tensor, imp: torch.Tensor) -> float:
    return float(((L.dequantize_int4(q).double() - w.double()).square() * imp.double()).sum())


@pytest.mark.parametrize("superblock", [False, True])
def test_skewed_importance_lowers_the_error_it_weighs(superblock: bool) -> None:
    """Channels of very different importance (a log-normal spread, as activations' mean squares have): the fit
    that knows them has less importance-weighted squared error than the plain one."""
    g = _gen()
    w = torch.randn(64, 512, generator=g) * 0.05
    imp = torch.exp(torch.randn(512, generator=g) * 2)
    plain = L.quantize_int4(w, 32, superblock=superblock)
    fitted = L.quantize_int4(w, 32, superblock=superblock, importance=imp / imp.max())
    assert _weighted_error(fitted, w, imp) < 0.9 * _weighted_error(plain, w, imp)


def test_importance_is_refused_where_no_fit_weighs() -> None:
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="weighted fits only"):
        L.quantize_int4(w, 32, asym=True, importance=torch.ones(64))
    with pytest.raises(ValueError, match="weighted fits only"):
        L.quantize_int4(w, 32, sym_fit="lsq", importance=torch.ones(64))
    with pytest.raises(ValueError, match="for a weight of 64 inputs"):
        L.quantize_int4(w, 32, importance=torch.ones(63))
