"""Qwen4-Exp's mixer configs: its QSA attention (gated attention over the tokens a block indexer selects) and
its Gated DeltaNet layers with per-layer n-gram embeddings (PLE), refinements of mixer_configs.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from recap.model.mixer_configs import AttentionConfig, GatedDeltaNetConfig, KVSpecs
from recap.model.state_spec import StateTensorSpec, conv_window_spec


@dataclass(frozen=True)
class QSAAttentionConfig(AttentionConfig):
    """Qwen4-Exp's attention: Qwen3.5's gated attention (head q/k norms, output gate, partial RoPE) whose
    queries attend only the tokens a block indexer selects (kernels/qsa.py). The indexer's raw key per token
    is cached beside K and V (`index_key`), so a prefix-cache hit restores the selection's inputs."""

    index_heads: int = 1
    index_head_dim: int = 128
    index_budget: int = 2048  # tokens of complete blocks a query selects
    index_ratio: int = 64  # tokens per block
    mixer: ClassVar[str] = "recap.model.layers.qsa_attention:QSAAttention"

    def kv_specs(self) -> KVSpecs:
        return (*super().kv_specs(), ("index_key", (1, self.index_head_dim)))

    def flops_weights(self, hidden: int) -> int:
        return super().flops_weights(hidden) + hidden * (self.index_heads + 1) * self.index_head_dim


@dataclass(frozen=True)
class PerLayerEmbeddingConfig:
    """Qwen4-Exp's per-layer n-gram embeddings (PLE, layers/ple.py) on some GDN layers: hashed 2..ngram_size-gram
    embeddings of the token and its predecessors gate a value into every hyper-connection stream, then a
    dilated depthwise conv (dilation ngram_size) adds local context. Its state: the last ngram_size - 1 token
    ids (a conv window of ids, fp32: exact) and the dilated conv's window."""

    layers: tuple[int, ...]  # the PLE layers, in order (their index here seeds their hashes)
    streams: int
    embed_dim: int
    conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size: int  # the token vocabulary (the hash multipliers' bound)
    vocab_base: int  # ngram_vocab_size_base
    vocab_multiple: int  # make_ngram_vocab_size_divisible_by
    seed: int
    shards: int  # split_ngram_parts: the table's pieces on disk
    eos_token_id: int

    @property
    def context(self) -> int:
        return self.ngram_size - 1

    @property
    def conv_span(self) -> int:
        """Taps of the dilated conv as a plain one (zeros between its taps)."""
        return (self.conv_kernel - 1) * self.ngram_size + 1


@dataclass(frozen=True)
class PLEGatedDeltaNetConfig(GatedDeltaNetConfig):
    """A Gated DeltaNet layer that also runs PLE (layer type "gdn_ple"): GDN's state plus PLE's windows."""

    ple: PerLayerEmbeddingConfig | None = None
    hidden_size: int = 0

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        assert self.ple is not None
        p, width = self.ple, self.ple.streams * self.hidden_size
        ids = StateTensorSpec("ple_ids", (p.context, p.context), torch.float32)
        return *super().state_specs(), ids, conv_window_spec(width, p.conv_span, "ple_conv")

    def flops_weights(self, hidden: int) -> int:
        assert self.ple is not None
        return super().flops_weights(hidden) + self.ple.embed_dim * (self.ple.streams + 1) * hidden
