"""Causal attention with a per-query relative position bias, over the paged KV cache (Inkling).

Each query carries its own bias profile over backward distances: rel [T, Hq, E], where rel[t, h, d] is added
to the logit of query t against the key d positions back (0 <= d < E; no bias beyond E). The bias depends on
the query alone, so the cache holds plain K/V and a prefix hit restores everything the attention reads.

paged_rel_bias_attention writes K/V and attends row by row over the gathered blocks (the blocks before a
window's first visible key are never read); rel_bias_attention_ref is the plain dense twin over one
contiguous sequence (the transformers formula: logits * scale + bias, causal / window mask, softmax).
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import AttentionMetadata
from recap.kernels.paged_attention import write_kv


def _bias(rel: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """rel [n, h, E] at query positions qpos [n] against keys kpos [s] -> bias [h, n, s] (0 past E or ahead)."""
    e = rel.shape[-1]
    dist = qpos[:, None] - kpos[None, :]  # (n, s)
    idx = dist.clamp(0, e - 1)[:, None, :].expand(-1, rel.shape[1], -1)  # (n, h, s)
    bias = rel.float().gather(-1, idx).transpose(0, 1)  # (h, n, s)
    return bias.masked_fill(((dist < 0) | (dist >= e))[None], 0.0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, hidden: torch.Tensor,
            scale: float, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """q [n, hq, dh], k / v [s, hkv, dh], bias [hq, n, s], hidden [n, s] (masked keys), sinks [n, hq] or None ->
    [n, hq, dh] fp32."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,shd->hns", q.float(), kk) * scale + bias
    logits = logits.masked_fill(hidden[None], -torch.inf)
    if sinks is None:
        return torch.einsum("hns,shd->nhd", logits.softmax(-1), vv)
    probs = torch.cat([logits, sinks.float().t()[:, :, None]], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hns,shd->nhd", probs, vv)


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    hidden = kpos[None, :] > qpos[:, None]
    if window is not None:
        hidden |= kpos[None, :] <= qpos[:, None] - window
    return hidden


def paged_rel_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the new K/V, then each row's new queries q [T, Hq, Dh] (at positions context..seq) over its cached
    keys, with the bias rel [T, Hq, E] -> [T, Hq, Dh]. Padding rows output zeros and read nothing; keys outside
    a query's window are zeroed as well as masked (their blocks may hold anything). sinks [T, Hq]: one more
    logit per query and head with no value, which only takes probability mass (Inkling-2)."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    bs, dev = meta.block_size, q.device
    for r, (ctx, seq) in enumerate(zip(meta.context_lens_list, meta.seq_lens_list)):
        if meta.is_padding[r]:
            continue
        lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        first = lo // bs
        ids = meta.block_tables[r][first : -(-seq // bs)]
        kpos = torch.arange(first * bs, seq, device=dev)
        keep = (kpos >= lo)[:, None, None]
        kk = k_cache.index_select(0, ids).flatten(0, 1)[: seq - first * bs].where(keep, 0.0)
        vv = v_cache.index_select(0, ids).flatten(0, 1)[: seq - first * bs].where(keep, 0.0)
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        qpos = torch.arange(ctx, seq, device=dev)
        bias = _bias(rel[start:end], qpos, kpos)
        sink = None if sinks is None else sinks[start:end]
        o = _attend(q[start:end], kk, vv, bias, _visible(qpos, kpos, sliding_window), scale, sink)
        out[start:end] = o.to(q.dtype)
    return out


def rel_bias_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One whole sequence, no cache, query by query: q [S, Hq, Dh], k / v [S, Hkv, Dh], rel [S, Hq, E] ->
    [S, Hq, Dh]. Query i sees keys j <= i (and i - j < window), each logit plus rel[i, h, i - j] if i - j < E;
    with sinks [S, Hq], the softmax also counts exp(sinks[i, h])."""
    s, hq, _ = q.shape
    group, e = hq // k.shape[1], rel.shape[-1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(s):
        lo = 0 if sliding_window is None else max(0, i - sliding_window + 1)
        for h in range(hq):
            keys, values = k[lo : i + 1, h // group].float(), v[lo : i + 1, h // group].float()
            logits = keys @ q[i, h].float() * scale
            for j in range(lo, i + 1):
                if i - j < e:
                    logits[j - lo] += rel[i, h, i - j].float()
            if sinks is not None:
                logits = torch.cat([logits, sinks[i, h : h + 1].float()])
            out[i, h] = logits.softmax(0)[: i + 1 - lo] @ values
    return out.to(q.dtype)
