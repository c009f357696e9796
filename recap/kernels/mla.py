"""Multi-head latent attention (DeepSeek-V2 MLA) over a paged cache of latents, for packed rows.

Glossary
- c [T, R]: a token's compressed KV latent (after kv_a_layernorm), R = kv_lora_rank; kr [T, P]: its rope key,
  shared by every head (P = qk_rope_head_dim; rotated by the caller when the model uses RoPE).
- latent_cache [NB, block_size, 1, R], rope_cache [NB, block_size, 1, P]: what MLA caches per token; K and V
  of the H heads are never stored.
- w_kv_b [H * (Dn + Dv), R]: kv_b_proj; per head, c -> [k_nope (Dn) | v (Dv)]. The key of head h at a token
  is [k_nope_h | kr], the query [T, H, Dn + P] and the output [T, H, Dv].
- row b: queries at positions [context_len, seq_len) attend every key at a position <= their own.

paged_mla_attention expands each row's latents into K and V once per step and runs the shared causal SDPA;
paged_mla_attention_ref is the plain twin (block by block, explicit softmax).
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import AttentionMetadata
from recap.kernels.paged_attention import _gather_blocks, _prefill_attention, write_kv


def _keys_values(
    c: torch.Tensor, kr: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int, dn: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """c [s, R], kr [s, P] (fp32) -> K [H, s, Dn + P], V [H, s, Dv]: expand the latents for every head."""
    s = c.shape[0]
    kv = (c @ w_kv_b.float().T).view(s, num_heads, -1)  # (s, h, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat((k_nope, kr[:, None, :].expand(s, num_heads, kr.shape[-1])), dim=-1)  # (s, h, dn + p)
    return k.transpose(0, 1), v.transpose(0, 1)


def paged_mla_attention(
    q: torch.Tensor,
    c: torch.Tensor,
    kr: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Write the new latents and rope keys, then causal MLA of every row's queries -> [T, H, Dv].

    Padding rows output zeros and read nothing.
    """
    write_kv(c[:, None, :], kr[:, None, :], latent_cache, rope_cache, meta.slot_mapping)
    t, h = q.shape[:2]
    dv = w_kv_b.shape[0] // h - qk_nope_head_dim
    out = torch.zeros(t, h, dv, dtype=q.dtype, device=q.device)
    qsl = meta.query_start_loc_list
    for r in range(len(meta.seq_lens_list)):
        if meta.is_padding[r]:
            continue
        start, end = qsl[r], qsl[r + 1]
        ctx, seq = meta.context_lens_list[r], meta.seq_lens_list[r]
        if ctx == 0 and c.dtype == latent_cache.dtype:  # every key is new: expand them straight from c
            cc, kk = c[start:end].float(), kr[start:end].float()
        else:
            table, seq_t = meta.block_tables[r : r + 1], meta.seq_lens[r : r + 1]
            cc = _gather_blocks(latent_cache, table, seq_t)[0, 0, :seq]  # (s, r)
            kk = _gather_blocks(rope_cache, table, seq_t)[0, 0, :seq]  # (s, p)
        keys, values = _keys_values(cc, kk, w_kv_b, h, qk_nope_head_dim)
        o = _prefill_attention(q[start:end].float().transpose(0, 1), keys, values, ctx, scale)  # (h, n, dv)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_mla_attention_ref(
    q: torch.Tensor,
    c: torch.Tensor,
    kr: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Plain reference of paged_mla_attention (same signature and side effects)."""
    write_kv(c[:, None, :], kr[:, None, :], latent_cache, rope_cache, meta.slot_mapping)
    t, h = q.shape[:2]
    dv = w_kv_b.shape[0] // h - qk_nope_head_dim
    out = torch.zeros(t, h, dv, dtype=q.dtype, device=q.device)
    bs = meta.block_size
    for r, (ctx, seq) in enumerate(zip(meta.context_lens_list, meta.seq_lens_list)):
        if meta.is_padding[r]:
            continue
        blocks = [int(b) for b in meta.block_tables[r][: -(-seq // bs)]]
        cc = torch.cat([latent_cache[b, :, 0] for b in blocks])[:seq].float()  # (s, r)
        kk = torch.cat([rope_cache[b, :, 0] for b in blocks])[:seq].float()  # (s, p)
        kv = (cc @ w_kv_b.float().T).view(seq, h, -1)
        keys = torch.cat((kv[..., :qk_nope_head_dim], kk[:, None, :].expand(seq, h, kk.shape[-1])), dim=-1)
        values = kv[..., qk_nope_head_dim:]  # (s, h, dv)
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        logits = torch.einsum("nhd,shd->hns", q[start:end].float(), keys) * scale  # (h, n, s)
        qpos = torch.arange(ctx, seq, device=q.device)[:, None]
        logits = logits.masked_fill(torch.arange(seq, device=q.device)[None, :] > qpos, -torch.inf)
        out[start:end] = torch.einsum("hns,shd->nhd", logits.softmax(-1), values).to(q.dtype)
    return out
