"""Qwen4-Exp's per-layer n-gram embeddings (PLE), run on a GDN layer's hyper-connection streams S [T, N D].

Per token t, with p_s its s-th predecessor (s = 0 .. n-1, n = ngram_size; a predecessor past an EOS, or before
the sequence, reads as EOS):
    h_k = (p_0 m_0) xor (p_1 m_1) ... xor (p_{k-1} m_{k-1})      for k = 2 .. n (int64; m: the layer's
                                                                  splitmix64 multipliers)
    row_{k,j} = h_k mod P_{k,j} + offset_{k,j}                  heads_per_ngram prime-sized tables per k
    e = concat of the rows' embeddings                           [E]
    g_i = signed sqrt((norm_key(key_proj e)_i . norm_query(S)_i) / sqrt(D))    one scalar per stream i
    v_i = sigmoid(g_i) value_proj(e);  S += v + silu(dilated_conv(norm_conv(v)))   (dilation n)
State (the GDN layer's slot): the last n - 1 token ids (+1; 0: none), as a conv window of one-hot taps in
fp32 (ids stay exact), and the dilated conv's window (a plain conv with zeros between its taps): the conv
kernels write both at every checkpoint, so a prefix-cache hit restores them.
The table is stored on disk in `shards` row ranges (`ngram_embedding.shard_{i}.weight`, torch.chunk's split).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.conv import causal_conv
from recap.model.layers.gated_residual import GroupedOffsetRMSNorm
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.qwen4_configs import PerLayerEmbeddingConfig

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def multipliers(cfg: PerLayerEmbeddingConfig, index: int) -> list[int]:
    """The odd hash multipliers of PLE layer `index` (each p * m fits int64 for p < vocab_size)."""
    half = max(1, ((1 << 63) - 1) // max(cfg.vocab_size, 1) // 2)
    base = cfg.seed + _PRIME * index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(cfg.ngram_size)]


def _is_prime(v: int) -> bool:
    return v == 2 or (v > 2 and v % 2 == 1 and all(v % d for d in range(3, math.isqrt(v) + 1, 2)))


@lru_cache(maxsize=8)
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= start."""
    out, v = [], start
    while len(out) < count:
        if _is_prime(v):
            out.append(v)
        v += 1
    return tuple(out)


def table_sizes(cfg: PerLayerEmbeddingConfig, index: int) -> tuple[list[int], int]:
    """(each head's prime table size, the padded rows of the layer's whole table)."""
    heads = cfg.context * cfg.heads_per_ngram
    sizes = list(primes_from(cfg.vocab_base, (index + 1) * heads)[index * heads :])
    return sizes, math.ceil(sum(sizes) / cfg.vocab_multiple) * cfg.vocab_multiple


def shard_rows(rows: int, shards: int) -> list[int]:
    """torch.chunk's split of `rows` into at most `shards` pieces."""
    size = -(-rows // shards)
    return [min(size, rows - s) for s in range(0, rows, size)]


class NGramEmbedding(nn.Module):
    def __init__(self, cfg: PerLayerEmbeddingConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        sizes, rows = table_sizes(cfg, index)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.register_buffer("mult", torch.tensor(multipliers(cfg, index)), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.ngram_embedding = nn.Module()
        dim, starts = cfg.embed_dim // len(sizes), [0]
        for i, n in enumerate(shard_rows(rows, cfg.shards)):
            shard = nn.Module()
            shard.weight = empty_param(n, dim, dtype=dtype)
            setattr(self.ngram_embedding, f"shard_{i}", shard)
            starts.append(starts[-1] + n)
        self.register_buffer("starts", torch.tensor(starts), persistent=False)

    def rows(self, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """tokens [T], prev [T, n-1] (predecessor ids + 1, 0: none) -> table rows [T, heads]."""
        eos, hp = self.cfg.eos_token_id, self.cfg.heads_per_ngram
        seen = torch.cumsum((prev == 0) | (prev == eos + 1), dim=1) > 0  # an EOS at or before this predecessor
        shifted = torch.where(seen, eos, prev - 1)
        mixed, blocks = tokens * self.mult[0], []
        for k in range(1, self.cfg.ngram_size):
            mixed = torch.bitwise_xor(mixed, shifted[:, k - 1] * self.mult[k])
            sizes, offsets = self.sizes[(k - 1) * hp : k * hp], self.offsets[(k - 1) * hp : k * hp]
            blocks.append(torch.remainder(mixed[:, None], sizes) + offsets)
        return torch.cat(blocks, dim=-1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, heads] rows -> [T, heads * dim] embeddings, read from the shard holding each row."""
        flat = rows.flatten()
        shard = torch.bucketize(flat, self.starts[1:], right=True)
        first = self.ngram_embedding.shard_0.weight
        out = torch.empty(flat.shape[0], first.shape[1], dtype=first.dtype, device=first.device)
        for i in shard.unique().tolist():
            m = shard == i
            out[m] = getattr(self.ngram_embedding, f"shard_{i}").weight[flat[m] - self.starts[i]]
        return out.view(rows.shape[0], -1)


class PerLayerEmbedding(Mixer):
    """Weights as on disk: ple_embedding.ngram_embedding.shard_{i}, key_proj, value_proj, norm_key, norm_query,
    norm_conv, conv1d [N D, 1, K] (dilation n)."""

    cache_group = "state"

    def __init__(self, hidden: int, cfg: PerLayerEmbeddingConfig, layer: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.hidden = cfg, hidden
        width = cfg.streams * hidden
        self.ple_embedding = NGramEmbedding(cfg, cfg.layers.index(layer), dtype)
        self.key_proj = Linear(cfg.embed_dim, width, False, dtype)
        self.value_proj = Linear(cfg.embed_dim, hidden, False, dtype)
        for name in ("norm_key", "norm_query", "norm_conv"):
            setattr(self, name, GroupedOffsetRMSNorm(width, hidden, eps, dtype))
        self.conv1d = nn.Module()
        self.conv1d.weight = empty_param(width, 1, cfg.conv_kernel, dtype=dtype)
        c = cfg.context  # channel j reads predecessor j + 1: tap c - 1 - j of the window's c + 1 (the last: now)
        taps = torch.zeros(c, c + 1)
        taps[torch.arange(c), c - 1 - torch.arange(c)] = 1.0
        self.register_buffer("id_taps", taps, persistent=False)

    def _dilated(self) -> torch.Tensor:
        w = self.conv1d.weight[:, 0]
        out = w.new_zeros(w.shape[0], self.cfg.conv_span)
        out[:, :: self.cfg.ngram_size] = w
        return out

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """streams [T, N D] -> streams + the layer's n-gram injection; updates the PLE windows of its slot."""
        state, t, n, d = self.layer_cache(caches, layer), streams.shape[0], self.cfg.streams, self.hidden
        ids = batch.input_ids
        x = (ids + 1).to(torch.float32)[:, None].expand(t, self.cfg.context).contiguous()
        prev = causal_conv(x, state["ple_ids"], self.id_taps, None, None, batch).round().long()
        e = self.ple_embedding(self.ple_embedding.rows(ids, prev))
        key = self.norm_key(self.key_proj(e)).view(t, n, d)
        gate = (key * self.norm_query(streams).view(t, n, d)).sum(-1, keepdim=True) / math.sqrt(d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        v = (torch.sigmoid(gate) * self.value_proj(e)[:, None, :]).flatten(-2)
        conv = causal_conv(self.norm_conv(v), state["ple_conv"], self._dilated(), None, "silu", batch)
        return streams + v + conv
