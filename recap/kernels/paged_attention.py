"""Causal attention over a paged KV cache, for packed rows of prefill, chunked prefill and decode.

Glossary
- q [T, Hq, Dh], k / v [T, Hkv, Dh]: the new tokens' projections; Hq = Hkv * group (GQA).
- k_cache / v_cache [NB, block_size, Hkv, Dh]: the block pool; token slot = block_id * block_size + offset.
- row b: its new queries sit at absolute positions [context_len, seq_len) and attend every key at a
  position <= their own, read through block_tables[b] (entries past the row's blocks are PAD_SLOT_ID).
- decode row: a row with one new token; all of them are attended in one padded batch (gather + mask).
- sliding_window w (None: full attention): a query at position p sees only keys at p - w + 1 .. p. Blocks
  entirely before the window of a row's first query are never read (their table entries may be the null
  block: the window group frees them while the request runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import AttentionMetadata
from recap.kernels.paged_decode import paged_decode


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """[NB * block_size, Hkv, Dh] view of a cache (a view, so writes land in the cache)."""
    return cache.view(-1, *cache.shape[2:])


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; tokens with slot PAD_SLOT_ID are skipped."""
    keep = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[keep]
    _flat(k_cache).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, key_start: int = 0
) -> torch.Tensor:
    """fp32 [b, Hkv, L, Dh] of each row's cached tokens, L = the longest row rounded up to whole blocks.

    One index per block, not per token. Only blocks a row owns are read: past its last needed block a row
    re-reads its own first block instead of its table's PAD_SLOT_ID entries. Positions at or past seq_len
    are zeroed (stale or never-written cache memory may hold NaN, which a mask alone would not stop).
    `tables` may start mid-sequence (a window): then seq_lens count from its first block, and positions
    before `key_start` (relative to it) are zeroed as well.
    """
    nb, bs, hkv, dh = cache.shape
    b = tables.shape[0]
    nblk = (seq_lens + bs - 1) // bs  # (b,)
    width = int(nblk.max())
    need = torch.arange(width, device=tables.device) < nblk[:, None]  # (b, width)
    ids = torch.where(need, tables[:, :width], tables[:, :1])
    kv = cache.index_select(0, ids.flatten()).view(b, width * bs, hkv, dh)
    pos = torch.arange(width * bs, device=tables.device)
    past = (pos >= seq_lens[:, None]) | (pos < key_start)  # (b, l)
    if bool(past.any()):
        kv = kv.masked_fill(past[:, :, None, None], 0.0)
    return kv.transpose(1, 2).float().contiguous()  # (b, hkv, l, dh)


def _decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query per row for `rows`, batched: gather their blocks into [b, L, Hkv, Dh] + mask.

    With a window, each row gathers from the block holding its first visible key (a per-row offset).

    The gathered K/V stay in the cache's token-major layout (SDPA reads the head-major views; a transposing
    copy plus a masked_fill over the whole gather made this ~5x slower at batch 8). Positions at or past
    seq_len are zeroed (stale or never-written cache memory may hold NaN, which a mask alone would not stop).
    """
    dev = q.device
    nb, bs, hkv, dh = k_cache.shape
    b = len(rows)
    rows_t = torch.tensor(rows, device=dev)
    seq_list = [meta.seq_lens_list[r] for r in rows]
    first_list = [0] * b if window is None else [max(0, s - window) // bs for s in seq_list]  # first block read
    width = max(-(-s // bs) - f for s, f in zip(seq_list, first_list))
    first = torch.tensor(first_list, device=dev)
    seq = meta.seq_lens[rows_t] - first * bs  # (b,) counted from each row's first block
    cols = (first[:, None] + torch.arange(width, device=dev)).clamp_max(meta.block_tables.shape[1] - 1)
    tables = meta.block_tables[rows_t[:, None], cols]  # (b, width)
    need = torch.arange(width, device=dev) < ((seq + bs - 1) // bs)[:, None]
    ids = torch.where(need, tables, tables[:, :1]).flatten()  # past a row's blocks: its own first block again
    length = width * bs
    pos = torch.arange(length, device=dev)
    past = pos >= seq[:, None]  # (b, l)
    if window is not None:  # keys before the window of the row's query (position seq - 1)
        past |= pos < (seq - window)[:, None]
    fill = past.flatten().nonzero().squeeze(1)
    kv = []
    for cache in (k_cache, v_cache):
        x = cache.index_select(0, ids).view(b * length, hkv * dh).float()
        kv.append(x.index_fill_(0, fill, 0.0).view(b, length, hkv, dh).transpose(1, 2))  # (b, hkv, l, dh)
    qq = q[torch.tensor([meta.query_start_loc_list[r] for r in rows], device=dev)].float()  # (b, hq, dh)
    hq = qq.shape[1]
    # GQA without copying K/V: the `group` query heads sharing a KV head act as that head's query rows.
    out = F.scaled_dot_product_attention(
        qq.view(b, hkv, hq // hkv, dh), kv[0], kv[1], attn_mask=~past[:, None, None, :], scale=scale
    )  # (b, hkv, group, dh)
    return out.reshape(b, hq, dh)


def _prefill_attention(
    qq: torch.Tensor,
    kk: torch.Tensor,
    vv: torch.Tensor,
    ctx: int,
    scale: float,
    key_start: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """One row's queries (hq, n, dh) at positions ctx.. over its keys (hkv, s, dh) at positions key_start..,
    causal (and inside the window, if any) -> (hq, n, dh).

    K/V heads are expanded to hq and the inputs made 4-D: that keeps SDPA on its fused CPU kernel (with
    enable_gqa, or 3-D inputs, it falls back to the math path: ~5x slower at 2048 tokens, and it builds
    the full score matrix).
    """
    hq, n, dh = qq.shape
    hkv, s = kk.shape[:2]
    if hkv != hq:
        kk = kk[:, None].expand(hkv, hq // hkv, s, dh).reshape(hq, s, dh)
        vv = vv[:, None].expand(hkv, hq // hkv, s, dh).reshape(hq, s, dh)
    if ctx == 0 and key_start == 0 and (window is None or window >= n):
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], is_causal=True, scale=scale)
    else:
        # query i sits at position ctx + i and sees keys key_start..ctx + i (and > ctx + i - window)
        kpos = torch.arange(key_start, key_start + s, device=qq.device)
        qpos = torch.arange(ctx, ctx + n, device=qq.device)[:, None]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask, scale=scale)
    return o[0]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    native: bool = False,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write the new K/V (unless `kv_written`: the caller's fused q/k preparation stored them, metadata.KVWrite),
    then causal attention of every row's new queries over its whole sequence (over the last `sliding_window`
    positions of each query, if given).

    Padding rows output zeros and read nothing. `native`: fp32 one-query rows take kernels/paged_decode.py
    (the caller checks paged_decode_available()).
    """
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    qsl = meta.query_start_loc_list
    rows = [r for r in range(len(meta.seq_lens_list)) if not meta.is_padding[r]]
    single = [r for r in rows if qsl[r + 1] - qsl[r] == 1]
    if single and native and q.dtype == k_cache.dtype == torch.float32 and len(single) == q.shape[0]:
        # every query is its own decode row (no padding, no prefill): the batch's own tables, no gather
        return paged_decode(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
    if single:
        starts = torch.tensor([qsl[r] for r in single], device=q.device)
        if native and q.dtype == k_cache.dtype == torch.float32:
            rows_t = torch.tensor(single, device=q.device)
            o = paged_decode(q[starts].contiguous(), k_cache, v_cache, meta.block_tables[rows_t],
                             meta.seq_lens[rows_t], scale, sliding_window)  # fmt: skip
        else:
            o = _decode_rows(q, k_cache, v_cache, meta, single, scale, sliding_window)
        out[starts] = o.to(q.dtype)
    for r in rows:
        start, end = qsl[r], qsl[r + 1]
        if end - start == 1:
            continue
        ctx, seq = meta.context_lens_list[r], meta.seq_lens_list[r]
        first = 0 if sliding_window is None else max(0, ctx - sliding_window + 1) // meta.block_size
        key_start = first * meta.block_size  # the first position read: the start of the first block needed
        if ctx == 0 and k.dtype == k_cache.dtype:  # every key is new: take them from k/v, not the cache
            kk, vv = k[start:end].float().transpose(0, 1), v[start:end].float().transpose(0, 1)  # (hkv, s, dh)
        else:
            table, seq_t = meta.block_tables[r : r + 1, first:], meta.seq_lens[r : r + 1] - key_start
            lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1) - key_start
            kk = _gather_blocks(k_cache, table, seq_t, lo)[0, :, : seq - key_start]  # (hkv, s, dh)
            vv = _gather_blocks(v_cache, table, seq_t, lo)[0, :, : seq - key_start]
        qq = q[start:end].float().transpose(0, 1)  # (hq, n, dh)
        o = _prefill_attention(qq, kk, vv, ctx, scale, key_start, sliding_window)
        out[start:end] = o.transpose(0, 1).to(q.dtype)  # (n, hq, dh)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain reference of paged_attention: per row, gather block by block, explicit masked softmax.

    With a window, only the blocks from the one holding the first query's first visible key are read, and
    keys outside a query's window are zeroed as well as masked (they may hold anything)."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    group = q.shape[1] // k.shape[1]
    bs = meta.block_size
    for r, (ctx, seq) in enumerate(zip(meta.context_lens_list, meta.seq_lens_list)):
        if meta.is_padding[r]:
            continue
        lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        first = lo // bs
        blocks = [int(b) for b in meta.block_tables[r][first : -(-seq // bs)]]
        kpos = torch.arange(first * bs, seq, device=q.device)
        visible = (kpos >= lo)[:, None, None]
        kk = torch.cat([k_cache[b] for b in blocks])[: seq - first * bs].float().repeat_interleave(group, dim=1)
        vv = torch.cat([v_cache[b] for b in blocks])[: seq - first * bs].float().repeat_interleave(group, dim=1)
        kk, vv = kk.where(visible, 0.0), vv.where(visible, 0.0)  # (s, hq, dh)
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        logits = torch.einsum("nhd,shd->hns", q[start:end].float(), kk) * scale  # (hq, n, s)
        qpos = torch.arange(ctx, seq, device=q.device)[:, None]
        hidden = kpos[None, :] > qpos
        if sliding_window is not None:
            hidden |= kpos[None, :] <= qpos - sliding_window
        logits = logits.masked_fill(hidden, -torch.inf)
        out[start:end] = torch.einsum("hns,shd->nhd", logits.softmax(-1), vv).to(q.dtype)
    return out
