"""Triton multi-head latent attention over the paged latent cache: the GPU twin of recap/kernels/mla.py.

Glossary (as in the reference): q [T, H, Dn + P], c [T, R] latents, kr [T, P] rope keys, latent_cache
[NB, block_size, 1, R], rope_cache [NB, block_size, 1, P], w_kv_b [H * (Dn + Dv), R] with per head
W_k [Dn, R] (rows 0..Dn) and W_v [Dv, R] (rows Dn..Dn + Dv).

Absorbed form: the key of head h at a token is [W_k c | kr], so q . key = (q_nope W_k) . c + q_rope . kr,
and the output W_v (sum_s p_s c_s). Queries are projected into the latent space once (q_lat [T, H, R]), the
attention kernel of triton/paged_attention.py runs over [latent | rope key] with the latent as the value
(one kv head shared by the H query heads), and its latent output goes through W_v. K and V of the heads
are never materialized; every row reads its latents once per head block, not once per head.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import AttentionMetadata
from recap.kernels.triton.paged_attention import attend, check_devices, write_kv


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
    check_devices(q.device, c=c, kr=kr, latent_cache=latent_cache, rope_cache=rope_cache, w_kv_b=w_kv_b,
                  slot_mapping=meta.slot_mapping, block_tables=meta.block_tables)  # fmt: skip
    write_kv(c[:, None, :], kr[:, None, :], latent_cache, rope_cache, meta.slot_mapping)
    t, h = q.shape[:2]
    dn, rank = qk_nope_head_dim, w_kv_b.shape[1]
    assert latent_cache.shape[2:] == (1, rank) and q.shape[2] - dn == rope_cache.shape[3]
    w = w_kv_b.view(h, -1, rank).to(q.dtype)  # (h, dn + dv, r)
    q_lat = torch.bmm(q[..., :dn].transpose(0, 1), w[:, :dn]).transpose(0, 1)  # (t, h, r)
    o_lat = torch.empty(t, h, rank, dtype=q.dtype, device=q.device)
    attend(q_lat.to(latent_cache.dtype), latent_cache, latent_cache, o_lat, meta, scale,
           rope=(q[..., dn:], rope_cache))  # fmt: skip
    out = torch.bmm(o_lat.transpose(0, 1), w[:, dn:].transpose(1, 2))  # (h, t, dv)
    return out.transpose(0, 1).contiguous()
