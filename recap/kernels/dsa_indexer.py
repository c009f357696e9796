"""The DSA-style indexer's token selection with k-pool compression (GLM-5.3-Flash), for one row.

Glossary (one row; its queries sit at positions ctx .. ctx + n - 1, its keys at 0 .. s - 1, s = ctx + n)
- keys [s, Di], gates [s, Di]: the indexer's per-token key (k_norm(wk(x))) and compression gate
  (compress_gate @ x), cached per token beside the layer's latents, so a prefix-cache hit restores them.
- pool p: the tokens [p P, (p + 1) P), P = kpool; only complete pools are candidates. Its key is a per-channel
  softmax-weighted mean of its tokens' keys, weights softmax over the pool of gates + ape [P, Di].
- q [n, Hi, Di], w [n, Hi]: each query's indexer heads and head weights (weights_proj(x) / sqrt(Hi)).
- score of pool p for query i: sum_h w[i, h] relu(q[i, h] . K_p / sqrt(Di)); a query sees a pool iff the
  pool's last token is at or before it.
- selection of query i: the top min(topk / P, visible pools) pools by score (ties: the earlier pool), plus
  (with `tail`) its own incomplete pool's tokens, positions t + 1 - ((t + 1) mod P) .. t.
  Exactly equal scores (every head's relu at 0 for two pools) go to the earlier pool whatever the chunking;
  transformers' torch.topk leaves such ties to its sort, so its parity tests use enough heads to have none.
Returns a bool mask [n, s]: which keys each query attends to.

dsa_select is batched over the row's queries; dsa_select_ref is the plain per-query twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexerShape:
    topk: int  # tokens' budget of selected pools (a multiple of kpool)
    kpool: int  # tokens per pool
    tail: bool  # the query's own incomplete pool is always attended

    def __post_init__(self) -> None:
        if self.kpool < 1 or self.topk < self.kpool or self.topk % self.kpool:
            raise ValueError(f"indexer topk {self.topk} must be a positive multiple of kpool {self.kpool}")
        if not self.tail and self.kpool > 1:
            # the first kpool - 1 queries would select nothing (transformers then averages every value of the
            # sequence, future ones included: not causal, so nothing a cache could reproduce)
            raise ValueError(f"an indexer with kpool {self.kpool} > 1 must always select the tail")


def _check(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor, ctx: int) -> None:
    n, s = q.shape[0], keys.shape[0]
    if w.shape != q.shape[:2] or gates.shape != keys.shape or s != ctx + n or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer inputs disagree: q {tuple(q.shape)}, w {tuple(w.shape)}, keys "
                         f"{tuple(keys.shape)}, gates {tuple(gates.shape)}, ctx {ctx}")  # fmt: skip


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """[s, Di] keys and gates -> [s // P, Di] keys of the complete pools (fp32)."""
    p, di = ape.shape
    npool = keys.shape[0] // p
    kk = keys[: npool * p].float().view(npool, p, di)
    logits = gates[: npool * p].float().view(npool, p, di) + ape.float()
    return (logits.softmax(dim=1) * kk).sum(dim=1)


def _tail_mask(ctx: int, n: int, s: int, kpool: int, device: torch.device) -> torch.Tensor:
    t = torch.arange(ctx, ctx + n, device=device)[:, None]
    start = t + 1 - (t + 1).remainder(kpool)
    pos = torch.arange(s, device=device)
    return (pos >= start) & (pos <= t)


def dsa_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
               ctx: int, shape: IndexerShape) -> torch.Tensor:  # fmt: skip
    """Each query's selected keys, bool [n, s] (see the module docstring)."""
    _check(q, w, keys, gates, ctx)
    n, s, p = q.shape[0], keys.shape[0], shape.kpool
    mask = _tail_mask(ctx, n, s, p, q.device) if shape.tail else torch.zeros(n, s, dtype=torch.bool, device=q.device)
    npool = s // p
    if npool == 0:
        return mask
    pk = pool_keys(keys, gates, ape)  # (npool, di)
    scores = torch.relu(torch.matmul(q.float(), pk.T) * q.shape[-1] ** -0.5)  # (n, hi, npool)
    index = torch.matmul(w.float()[:, None, :], scores)[:, 0]  # (n, npool)
    t = torch.arange(ctx, ctx + n, device=q.device)[:, None]
    visible = (torch.arange(npool, device=q.device) + 1) * p - 1 <= t  # (n, npool)
    order = index.masked_fill(~visible, -torch.inf).sort(dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(visible).scatter_(1, order[:, : min(shape.topk // p, npool)], True) & visible
    mask[:, : npool * p] |= chosen.repeat_interleave(p, dim=1)
    return mask


def dsa_select_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                   ctx: int, shape: IndexerShape) -> torch.Tensor:  # fmt: skip
    """Plain twin of dsa_select: one query and one pool at a time."""
    _check(q, w, keys, gates, ctx)
    n, s, p = q.shape[0], keys.shape[0], shape.kpool
    mask = torch.zeros(n, s, dtype=torch.bool, device=q.device)
    for i in range(n):
        t = ctx + i
        visible = (t + 1) // p  # complete pools ending at or before t
        scored = []
        for j in range(visible):
            toks = range(j * p, (j + 1) * p)
            wts = torch.stack([gates[k].float() + ape[k - j * p].float() for k in toks]).softmax(dim=0)
            key = sum(wts[k - j * p] * keys[k].float() for k in toks)
            score = sum(float(w[i, h]) * max(float(q[i, h].float() @ key) / q.shape[-1] ** 0.5, 0.0)
                        for h in range(q.shape[1]))  # fmt: skip
            scored.append((-score, j))
        for _, j in sorted(scored)[: shape.topk // p]:
            mask[i, j * p : (j + 1) * p] = True
        if shape.tail:
            mask[i, t + 1 - (t + 1) % p : t + 1] = True
    return mask.to(q.device)
