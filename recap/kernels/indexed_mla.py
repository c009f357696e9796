"""Indexed (DSA-style sparse) MLA over the paged cache, for packed rows (GLM-5.3-Flash; no positional encoding).

Glossary
- c [T, R]: a token's compressed KV latent (after kv_a_layernorm); latent_cache [NB, block_size, 1, R].
- ik, ig [T, Di]: the indexer's per-token key and compression gate; key_cache / gate_cache [NB, block_size,
  1, Di] sit beside the latents in the layer's KV blocks, so a prefix-cache hit restores them with the KV.
- selection [n, s] bool, one per row (None for padding): which keys each query of the row attends to
  (kernels/dsa_indexer.py); a layer whose indexer is "shared" reuses the previous full layer's selections.
- w_kv_b [H * (Dn + Dv), R]: kv_b_proj; per head, c -> [k_nope (Dn) | v (Dv)]; q [T, H, Dn]; out [T, H, Dv].

paged_dsa_select writes ik / ig and selects per row; paged_sparse_mla_attention writes c and attends over the
selected keys only. paged_sparse_mla_attention_ref is the plain twin (block by block, explicit softmax).
Both are exact, not fast: the selection is a dense [n, s] mask over every key of the row (memory O(n s) per
row and step, bounded by the step's token budget), so no step is cheaper than dense MLA yet; a kernel that
gathers only the selected keys is the next step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.dsa_indexer import IndexerShape, dsa_select
from recap.kernels.metadata import AttentionMetadata
from recap.kernels.paged_attention import _gather_blocks

Selections = list[torch.Tensor | None]


def write_tokens(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's row x [T, D] at its slot of cache [NB, block_size, 1, D]; PAD_SLOT_ID is skipped."""
    keep = slot_mapping != PAD_SLOT_ID
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping[keep], x[keep].to(cache.dtype))


def _row_tokens(cache: torch.Tensor, meta: AttentionMetadata, r: int) -> torch.Tensor:
    """Row r's cached tokens 0 .. seq_len - 1 of a [NB, block_size, 1, D] cache, fp32 [s, D]."""
    seq = meta.seq_lens_list[r]
    return _gather_blocks(cache, meta.block_tables[r : r + 1], meta.seq_lens[r : r + 1])[0, 0, :seq]


def paged_dsa_select(q: torch.Tensor, w: torch.Tensor, ik: torch.Tensor, ig: torch.Tensor, key_cache: torch.Tensor,
                     gate_cache: torch.Tensor, meta: AttentionMetadata, ape: torch.Tensor,
                     shape: IndexerShape) -> Selections:  # fmt: skip
    """Write the indexer's keys and gates, then each row's selection [n, s] (None for padding rows).

    Keys are always read back from the cache, so a row computes the same whether its prefix was cached or not.
    """
    write_tokens(ik, key_cache, meta.slot_mapping)
    write_tokens(ig, gate_cache, meta.slot_mapping)
    qsl, out = meta.query_start_loc_list, []
    for r in range(len(meta.seq_lens_list)):
        if meta.is_padding[r]:
            out.append(None)
            continue
        keys, gates = _row_tokens(key_cache, meta, r), _row_tokens(gate_cache, meta, r)
        s, e = qsl[r], qsl[r + 1]
        out.append(dsa_select(q[s:e], w[s:e], keys, gates, ape, meta.context_lens_list[r], shape))
    return out


def _expand(c: torch.Tensor, w_kv_b: torch.Tensor, h: int, dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """c [s, R] -> K [s, H, Dn], V [s, H, Dv] (fp32)."""
    kv = (c.float() @ w_kv_b.float().T).view(c.shape[0], h, -1)
    return kv[..., :dn], kv[..., dn:]


def _check(selections: Selections, meta: AttentionMetadata) -> None:
    qsl = meta.query_start_loc_list
    for r, sel in enumerate(selections):
        want = None if meta.is_padding[r] else (qsl[r + 1] - qsl[r], meta.seq_lens_list[r])
        if (sel is None and want is not None) or (sel is not None and tuple(sel.shape) != want):
            raise ValueError(f"row {r}: selection {None if sel is None else tuple(sel.shape)}, expected {want}")
    if len(selections) != len(meta.seq_lens_list):
        raise ValueError(f"{len(selections)} selections for {len(meta.seq_lens_list)} rows")


def paged_sparse_mla_attention(q: torch.Tensor, c: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                               w_kv_b: torch.Tensor, qk_nope_head_dim: int, scale: float,
                               selections: Selections) -> torch.Tensor:  # fmt: skip
    """Write the new latents, then each row's queries over their selected keys -> [T, H, Dv]; padding rows
    output zeros and read nothing."""
    _check(selections, meta)
    write_tokens(c, latent_cache, meta.slot_mapping)
    t, h = q.shape[:2]
    out = torch.zeros(t, h, w_kv_b.shape[0] // h - qk_nope_head_dim, dtype=q.dtype, device=q.device)
    qsl = meta.query_start_loc_list
    for r, sel in enumerate(selections):
        if sel is None:
            continue
        k, v = _expand(_row_tokens(latent_cache, meta, r), w_kv_b, h, qk_nope_head_dim)
        qq = q[qsl[r] : qsl[r + 1]].float().transpose(0, 1)  # (h, n, dn)
        o = F.scaled_dot_product_attention(qq[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=sel, scale=scale)  # fmt: skip
        out[qsl[r] : qsl[r + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


def paged_sparse_mla_attention_ref(q: torch.Tensor, c: torch.Tensor, latent_cache: torch.Tensor,
                                   meta: AttentionMetadata, w_kv_b: torch.Tensor, qk_nope_head_dim: int,
                                   scale: float, selections: Selections) -> torch.Tensor:  # fmt: skip
    """Plain reference of paged_sparse_mla_attention (same signature and side effects)."""
    _check(selections, meta)
    write_tokens(c, latent_cache, meta.slot_mapping)
    t, h = q.shape[:2]
    out = torch.zeros(t, h, w_kv_b.shape[0] // h - qk_nope_head_dim, dtype=q.dtype, device=q.device)
    bs = meta.block_size
    for r, sel in enumerate(selections):
        if sel is None:
            continue
        seq = meta.seq_lens_list[r]
        blocks = [int(b) for b in meta.block_tables[r][: -(-seq // bs)]]
        k, v = _expand(torch.cat([latent_cache[b, :, 0] for b in blocks])[:seq], w_kv_b, h, qk_nope_head_dim)
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        logits = torch.einsum("nhd,shd->hns", q[start:end].float(), k) * scale
        logits = logits.masked_fill(~sel, -torch.inf)
        out[start:end] = torch.einsum("hns,shd->nhd", logits.softmax(-1), v).to(q.dtype)
    return out
