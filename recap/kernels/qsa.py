"""Qwen4-Exp's QSA: softmax attention over the tokens a block indexer selects, over the paged cache.

Glossary (one row; its queries at positions ctx .. ctx + n - 1, its keys at 0 .. s - 1, s = ctx + n)
- raw key [s, Di]: the indexer's per-token key (its share of index_qk_proj(x)), cached per token beside K and
  V in the layer's KV blocks (`index_key`), so a prefix-cache hit restores what the selection reads.
- block b: the tokens [b r, (b + 1) r), r = compress ratio; only complete blocks are candidates. Its key:
  mean of its raw keys (fp32, cast back), RMS-normed with (1 + w), RoPE at position b r on the first
  rotary dims (rotate-half pairs).
- q [n, Hi, Di]: each query's indexer heads, normed and RoPE'd at its own position by the layer.
- score of block b for query i: sum_h relu(q[i, h] . K_b) / sqrt(Di); a query sees a block iff the block's
  last token is at or before it. Selection: the top min(budget / r, visible blocks) blocks, plus the query's
  own incomplete block, positions t + 1 - ((t + 1) mod r) .. t (transformers' "tail").
Attention: GQA softmax attention (scale 1 / sqrt(Dh)) of each query over its selected keys only.

qsa_select is batched over a row's queries, qsa_select_ref the plain per-query twin; paged_qsa_attention
writes K, V and raw keys and attends, paged_qsa_attention_ref its plain twin (explicit softmax). Exact, not
fast: the selection is a dense [n, s] mask per row (as kernels/indexed_mla.py's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.dsa_indexer import _tail_mask
from recap.kernels.metadata import AttentionMetadata
from recap.kernels.paged_attention import _gather_blocks


@dataclass(frozen=True)
class QSAShape:
    budget: int  # tokens of complete blocks each query may select (a multiple of ratio)
    ratio: int  # tokens per block
    norm_eps: float  # the block keys' RMSNorm
    rotary_dim: int  # leading dims of a block key that RoPE turns (0: none)

    def __post_init__(self) -> None:
        if self.ratio < 1 or self.budget < self.ratio or self.budget % self.ratio:
            raise ValueError(f"QSA budget {self.budget} must be a positive multiple of the ratio {self.ratio}")


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, r: int) -> torch.Tensor:
    """x [m, D] with its first r dims turned at positions pos [m] (rotate-half pairs, cos/sin in x's dtype)."""
    if r == 0:
        return x
    freqs = pos[:, None].float() * inv_freq.float()
    cos, sin = (torch.cat((f, f), dim=-1).to(x.dtype) for f in (freqs.cos(), freqs.sin()))
    rot = x[:, :r]
    turned = rot * cos + torch.cat((-rot[:, r // 2 :], rot[:, : r // 2]), dim=-1) * sin
    return torch.cat((turned, x[:, r:]), dim=-1)


def block_keys(keys: torch.Tensor, norm_w: torch.Tensor, inv_freq: torch.Tensor, shape: QSAShape) -> torch.Tensor:
    """[s, Di] raw keys -> [s // r, Di] keys of the complete blocks (in keys' dtype)."""
    r, di = shape.ratio, keys.shape[1]
    nb = keys.shape[0] // r
    pooled = keys[: nb * r].float().view(nb, r, di).mean(dim=1).to(keys.dtype).float()
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + shape.norm_eps) * (1.0 + norm_w.float())
    pos = torch.arange(nb, device=keys.device) * r
    return _rope(normed.to(keys.dtype), pos, inv_freq, shape.rotary_dim)


def qsa_select(q: torch.Tensor, keys: torch.Tensor, norm_w: torch.Tensor, inv_freq: torch.Tensor, ctx: int,
               shape: QSAShape) -> torch.Tensor:  # fmt: skip
    """Each query's selected keys, bool [n, s] (see the module docstring)."""
    n, s, r = q.shape[0], keys.shape[0], shape.ratio
    mask = _tail_mask(ctx, n, s, r, q.device)
    nb = s // r
    if nb == 0:
        return mask
    bk = block_keys(keys, norm_w, inv_freq, shape).float()  # (nb, di)
    scores = torch.relu(torch.matmul(q.float(), bk.T)).sum(dim=1) / math.sqrt(q.shape[-1])  # (n, nb)
    t = torch.arange(ctx, ctx + n, device=q.device)[:, None]
    visible = (torch.arange(nb, device=q.device) + 1) * r - 1 <= t
    order = scores.masked_fill(~visible, -torch.inf).sort(dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(visible).scatter_(1, order[:, : min(shape.budget // r, nb)], True) & visible
    mask[:, : nb * r] |= chosen.repeat_interleave(r, dim=1)
    return mask


def qsa_select_ref(q: torch.Tensor, keys: torch.Tensor, norm_w: torch.Tensor, inv_freq: torch.Tensor, ctx: int,
                   shape: QSAShape) -> torch.Tensor:  # fmt: skip
    """Plain twin of qsa_select: one query and one block at a time."""
    n, s, r = q.shape[0], keys.shape[0], shape.ratio
    bk = block_keys(keys, norm_w, inv_freq, shape).float()
    mask = torch.zeros(n, s, dtype=torch.bool, device=q.device)
    for i in range(n):
        t = ctx + i
        scored = []
        for b in range((t + 1) // r):  # complete blocks ending at or before t
            score = sum(max(float(q[i, h].float() @ bk[b]), 0.0) for h in range(q.shape[1])) / math.sqrt(q.shape[-1])
            scored.append((-score, b))
        for _, b in sorted(scored)[: shape.budget // r]:
            mask[i, b * r : (b + 1) * r] = True
        mask[i, t + 1 - (t + 1) % r : t + 1] = True
    return mask.to(q.device)


def _write(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store each token's x [T, H, D] at its slot of cache [NB, block_size, H, D]; PAD_SLOT_ID is skipped."""
    keep = slots != PAD_SLOT_ID
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots[keep], x[keep].to(cache.dtype))


def _row(cache: torch.Tensor, meta: AttentionMetadata, r: int) -> torch.Tensor:
    """Row r's cached tokens, fp32 [H, s, D]."""
    seq = meta.seq_lens_list[r]
    return _gather_blocks(cache, meta.block_tables[r : r + 1], meta.seq_lens[r : r + 1])[0, :, :seq]


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qi: torch.Tensor, caches: tuple[torch.Tensor, ...],
          meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Write the step's K, V and raw keys, then per non-padding row: (start, end, ctx, K, V, raw keys)."""
    for x, cache in zip((k, v, qi[:, None]), caches):
        _write(x, cache, meta.slot_mapping)
    qsl, out = meta.query_start_loc_list, []
    for r in range(len(meta.seq_lens_list)):
        if not meta.is_padding[r]:
            keys = _row(caches[2], meta, r)[0]
            out.append((qsl[r], qsl[r + 1], meta.context_lens_list[r], _row(caches[0], meta, r),
                        _row(caches[1], meta, r), keys))  # fmt: skip
    return out


def paged_qsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                        caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                        norm_w: torch.Tensor, inv_freq: torch.Tensor, shape: QSAShape,
                        scale: float) -> torch.Tensor:  # fmt: skip
    """q [T, Hq, Dh], k / v [T, Hkv, Dh], indexer queries iq [T, Hi, Di] and raw keys ik [T, Di]; caches
    (k_cache, v_cache, index_key_cache) -> [T, Hq, Dh] (zeros for padding rows)."""
    out = torch.zeros_like(q)
    for start, end, ctx, kk, vv, keys in _rows(q, k, v, ik, caches, meta):
        sel = qsa_select(iq[start:end], keys, norm_w, inv_freq, ctx, shape)
        rep = q.shape[1] // kk.shape[0]
        kk, vv = kk.repeat_interleave(rep, dim=0), vv.repeat_interleave(rep, dim=0)
        qq = q[start:end].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=sel, scale=scale)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def paged_qsa_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                            caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                            norm_w: torch.Tensor, inv_freq: torch.Tensor, shape: QSAShape,
                            scale: float) -> torch.Tensor:  # fmt: skip
    """Plain twin of paged_qsa_attention: the per-query selection and an explicit softmax per head."""
    out = torch.zeros_like(q)
    for start, end, ctx, kk, vv, keys in _rows(q, k, v, ik, caches, meta):
        sel = qsa_select_ref(iq[start:end], keys, norm_w, inv_freq, ctx, shape)
        rep = q.shape[1] // kk.shape[0]
        for h in range(q.shape[1]):
            logits = q[start:end, h].float() @ kk[h // rep].T * scale  # (n, s)
            out[start:end, h] = (logits.masked_fill(~sel, -torch.inf).softmax(-1) @ vv[h // rep]).to(q.dtype)
    return out
