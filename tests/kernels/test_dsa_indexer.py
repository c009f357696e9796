"""The DSA indexer's selection: batched vs the plain per-query twin on random inputs (odd sizes, a cached
prefix), chunked calls vs one call over the whole sequence, and against transformers' Glm5NextTextIndexer
(no cache) with top-k well below the sequence length."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.dsa_indexer import IndexerShape, dsa_select, dsa_select_ref

hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")


def _inputs(gen: torch.Generator, n: int, s: int, hi: int, di: int, p: int) -> tuple[torch.Tensor, ...]:
    sizes = ((n, hi, di), (n, hi), (s, di), (s, di), (p, di))
    return tuple(torch.randn(size, generator=gen) for size in sizes)


@pytest.mark.parametrize("seed", range(10))
def test_fast_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    p = rng.choice([1, 2, 3, 4])
    shape = IndexerShape(topk=p * rng.randint(1, 4), kpool=p, tail=p > 1 or rng.random() < 0.5)
    ctx, n = rng.choice([0, rng.randint(1, 30)]), rng.randint(1, 17)
    q, w, keys, gates, ape = _inputs(gen, n, ctx + n, rng.randint(1, 5), rng.randint(2, 9), p)
    mask = dsa_select(q, w, keys, gates, ape, ctx, shape)
    assert torch.equal(mask, dsa_select_ref(q, w, keys, gates, ape, ctx, shape))
    assert not mask.triu(ctx + 1).any()  # causal
    assert bool(mask.sum(-1).le(shape.topk + (p - 1 if shape.tail else 0)).all())
    if shape.tail:
        assert bool(mask.any(-1).all())


@pytest.mark.parametrize("seed", range(4))
def test_chunked_calls_equal_one_call(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    length, shape = rng.randint(20, 50), IndexerShape(topk=6, kpool=3, tail=True)
    q, w, keys, gates, ape = _inputs(gen, length, length, 4, 8, 3)
    whole = dsa_select(q, w, keys, gates, ape, 0, shape)
    cuts = sorted(rng.sample(range(1, length), k=4))
    for s, e in zip([0, *cuts], [*cuts, length]):
        part = dsa_select(q[s:e], w[s:e], keys[:e], gates[:e], ape, s, shape)
        assert torch.equal(part, whole[s:e, :e])


def _hf_indexer(seed: int, topk: int, kpool: int, tail: bool) -> torch.nn.Module:
    cfg = hf_config.Glm5NextTextConfig(hidden_size=24, q_lora_rank=12, index_n_heads=16, index_head_dim=10,
                                       index_topk=topk, index_kpool=kpool, index_kpool_always_select_tail=tail,
                                       num_hidden_layers=1, vocab_size=32)  # fmt: skip
    ind = hf.Glm5NextTextIndexer(cfg, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ind.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return ind


CASES = [(0, 8, 4, True, 37), (1, 6, 3, True, 29), (2, 4, 1, False, 19), (3, 8, 2, True, 33)]


@pytest.mark.parametrize(("seed", "topk", "kpool", "tail", "length"), CASES)
def test_matches_transformers_indexer(seed: int, topk: int, kpool: int, tail: bool, length: int) -> None:
    ind = _hf_indexer(seed, topk, kpool, tail)
    gen = torch.Generator().manual_seed(50 + seed)
    x, q_resid = torch.randn(1, length, 24, generator=gen), torch.randn(1, length, 12, generator=gen)
    idx = ind(x, q_resid, torch.ones(1, length, dtype=torch.bool), None)[0].long()  # (s, width), -1 = none
    expected = torch.zeros(length, length + 1, dtype=torch.bool)
    expected.scatter_(1, idx.where(idx >= 0, length), True)
    with torch.no_grad():
        q = ind.wq_b(q_resid[0]).view(length, 16, 10)
        w = ind.weights_proj(x[0]) * 16**-0.5
        keys, gates = ind.k_norm(ind.wk(x[0])), x[0] @ ind.index_kpool_compress_gate.T
    mask = dsa_select(q, w, keys, gates, ind.index_kpool_compress_ape, 0, IndexerShape(topk, kpool, tail))
    assert torch.equal(mask, expected[:, :length])
    assert bool((mask.sum(-1) < torch.arange(1, length + 1)).any())  # the selection is really sparse


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of kpool"):
        IndexerShape(topk=5, kpool=2, tail=True)
    with pytest.raises(ValueError, match="always select the tail"):
        IndexerShape(topk=4, kpool=2, tail=False)
    q, w, keys, gates, ape = _inputs(torch.Generator().manual_seed(0), 3, 4, 2, 5, 2)
    with pytest.raises(ValueError, match="disagree"):
        dsa_select(q, w, keys, gates, ape, 0, IndexerShape(2, 2, True))
