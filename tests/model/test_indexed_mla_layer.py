"""The indexed MLA layer (GLM-5.3-Flash "indexed_attention") against transformers' Glm5NextTextAttention with
the eager path (no cache), a full-indexer layer and a shared one that reuses its selection, top-k well
below the sequence length; and the same layer over the paged cache in chunks (prefix read back from the
blocks, indexer keys included) equal to one uncached pass."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import KVCache, ModelCaches
from recap.model.layers.indexed_mla import IndexedMLAttention
from recap.model.mixer_configs import IndexedMLAConfig

hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")

HIDDEN, BLOCK, NUM_BLOCKS = 24, 4, 32


def _hf_config(topk: int, kpool: int, tail: bool) -> object:
    cfg = hf_config.Glm5NextTextConfig(
        hidden_size=HIDDEN, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=12, kv_lora_rank=10,
        qk_nope_head_dim=8, v_head_dim=6, qk_rope_head_dim=0, index_n_heads=16, index_head_dim=8,
        index_topk=topk, index_kpool=kpool, index_kpool_always_select_tail=tail, num_hidden_layers=2,
        vocab_size=32, indexer_types=["full", "shared"], rms_norm_eps=1e-5,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _ours(cfg: object, indexer: str) -> IndexedMLAConfig:
    return IndexedMLAConfig(num_heads=3, kv_lora_rank=10, qk_nope_head_dim=8, v_head_dim=6, q_lora_rank=12,
                            index_heads=16, index_head_dim=8, index_topk=cfg.index_topk,  # type: ignore[attr-defined]
                            index_kpool=cfg.index_kpool, index_tail=cfg.index_kpool_always_select_tail,  # type: ignore[attr-defined]
                            indexer=indexer, norm_eps=1e-5)  # fmt: skip


def _pair(seed: int, topk: int, kpool: int, tail: bool) -> tuple[list[torch.nn.Module], list[IndexedMLAttention]]:
    cfg = _hf_config(topk, kpool, tail)
    gen = torch.Generator().manual_seed(seed)
    refs = [hf.Glm5NextTextAttention(cfg, i) for i in range(2)]
    ours = []
    for i, ref in enumerate(refs):
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
        layer = IndexedMLAttention(HIDDEN, _ours(cfg, ["full", "shared"][i]), torch.float32)
        layer.load_state_dict(ref.state_dict())
        ours.append(layer)
    return refs, ours


def _caches(layers: list[IndexedMLAttention]) -> ModelCaches:
    kv = {i: KVCache({name: torch.zeros(NUM_BLOCKS, BLOCK, *shape) for name, shape in layer.cfg.kv_specs()})
          for i, layer in enumerate(layers)}  # fmt: skip
    return ModelCaches(kv=kv, state={}, slot_positions=torch.zeros(0, dtype=torch.long), block_size=BLOCK,
                       num_kv_blocks=NUM_BLOCKS, num_state_slots=0)  # fmt: skip


def _batch(n: int, ctx: int, blocks: list[int]) -> ForwardBatch:
    spec = SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=blocks)
    return build_forward_batch([spec], block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)


def _run(layers: list[IndexedMLAttention], x: torch.Tensor, caches: ModelCaches, batch: ForwardBatch) -> list:
    out0, sel = layers[0].attend(x, batch, caches, 0, None)
    out1, _ = layers[1].attend(x, batch, caches, 1, sel)
    return [out0, out1]


CASES = [(0, 8, 4, True, 31), (1, 6, 3, True, 26), (2, 4, 1, False, 17), (3, 8, 2, True, 23), (4, 3, 1, True, 14)]


@pytest.mark.parametrize(("seed", "topk", "kpool", "tail", "length"), CASES)
def test_matches_transformers_and_chunks_match_one_pass(seed: int, topk: int, kpool: int, tail: bool,
                                                        length: int) -> None:  # fmt: skip
    refs, ours = _pair(seed, topk, kpool, tail)
    x = torch.randn(1, length, HIDDEN, generator=torch.Generator().manual_seed(70 + seed))
    mask = torch.ones(1, length, dtype=torch.bool)
    with torch.no_grad():
        y0, _, topk_idx = refs[0](x, mask)
        y1, _, _ = refs[1](x, mask, prev_topk_indices=topk_idx)
        assert bool(((topk_idx >= 0).sum(-1) < torch.arange(1, length + 1)).any())  # really sparse
        blocks = random.Random(seed).sample(range(1, NUM_BLOCKS), -(-length // BLOCK))
        whole = _run(ours, x[0], _caches(ours), _batch(length, 0, blocks))
        torch.testing.assert_close(whole[0], y0[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(whole[1], y1[0], rtol=1e-4, atol=1e-5)
        caches, parts = _caches(ours), []
        cuts = sorted(random.Random(seed).sample(range(1, length), k=3))
        for s, e in zip([0, *cuts], [*cuts, length]):
            parts.append(_run(ours, x[0, s:e], caches, _batch(e - s, s, blocks)))
    for i in range(2):
        torch.testing.assert_close(torch.cat([p[i] for p in parts]), whole[i], rtol=1e-5, atol=1e-6)


def test_shared_selection_is_required_and_refused() -> None:
    _, ours = _pair(0, 8, 4, True)
    caches, batch, x = _caches(ours), _batch(5, 0, [1, 2]), torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="needs shared selections"):
        ours[1](x, batch, caches, 1)
    _, sel = ours[0].attend(x, batch, caches, 0, None)
    with pytest.raises(ValueError, match="takes no shared selections"):
        ours[0].attend(x, batch, caches, 0, sel)
    assert [n for n, _ in ours[1].cfg.kv_specs()] == ["latent"]
    assert [n for n, _ in ours[0].cfg.kv_specs()] == ["latent", "index_key", "index_gate"]
