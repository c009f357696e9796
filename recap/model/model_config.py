"""`ModelConfig`: the frozen config the layers ever read, with normalized per-layer lists.

- `layer_types[i]`: the token mixer of layer i and so its caches, one of the kinds of layer_kinds.py
  ("mamba1" | "mamba2" | "gdn" | "short_conv" | "kda" | "lightning" | "rglru" | "rwkv" | "mlstm": a state slot
  part;
  "attention": KV, or MLA when `mla` is set; "none": an MLP/MoE-only layer; "hybrid": attention AND a Mamba2 state
  in one layer, the family's model file says how they combine)
- `mlp_types[i]`:   "none" | "dense" | "moe" (the feed-forward of the layer, if any)
Multipliers (muP and friends) are explicit fields, 1.0 when a family has none. The per-layer questions (which
layers hold KV or state, their specs, FLOPs) are answered from the layer-kind table and the mixer configs'
shared protocol, never by naming a kind. Translators (translators/) build it from an HF config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from recap.model.feed_forward_configs import MLP_TYPES, MLPConfig, MoEConfig
from recap.model.inkling_configs import OutputConvsConfig
from recap.model.layer_kinds import LayerKind, layer_kind
from recap.model.mixer_configs import (
    AttentionConfig,
    GatedDeltaNetConfig,
    IndexedMLAConfig,
    KDAConfig,
    KVSpecs,
    LightningConfig,
    Mamba1Config,
    Mamba2Config,
    MixerConfig,
    MLAConfig,
    ShortConvConfig,
)
from recap.model.qwen4_configs import PLEGatedDeltaNetConfig
from recap.model.rglru_config import RGLRUConfig
from recap.model.rwkv_config import RwkvConfig
from recap.model.state_spec import StateTensorSpec, check_specs
from recap.model.xlstm_config import XlstmConfig
from recap.model.zaya_config import CCAConfig


@dataclass(frozen=True)
class SharedBlocksConfig:
    """Transformer blocks whose weights several layers share, each use with its own low-rank adapters (Zamba2).

    The u-th "hybrid" layer (in layer order) runs block u % num_blocks; adapters are indexed by u.
    """

    num_blocks: int
    adapter_rank: int  # 0: no adapters (Zamba v1)
    attention_adapters: bool  # q/k/v adapters too (use_shared_attention_adapter); the MLP always has gate_up ones
    # transformers ties the shared copies only along with the word embeddings: with tie_word_embeddings
    # false every use keeps its own copy of its block (and the checkpoint stores each), so this is False then.
    shared: bool = True


@dataclass(frozen=True)
class HyperConnectionConfig:
    """Manifold-constrained hyper-connections (GLM-5.3-Flash): `streams` residual streams per token, mixed
    around every block (layers/hyper_connection.py)."""

    streams: int
    sinkhorn_iters: int
    eps: float


@dataclass(frozen=True)
class GatedResidualConfig:
    """Qwen4-Exp's hyper-connections: `streams` residual streams per token; each block reads a sigmoid-gated
    mean of the normed streams (a rank-`rank` mixer) and writes its output into every stream with its own
    weight (layers/gated_residual.py)."""

    streams: int
    rank: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    norm_eps: float
    tie_word_embeddings: bool
    ssm_chunk_size: int  # chunk grid the runner passes to build_forward_batch
    residual_in_fp32: bool = False
    embedding_multiplier: float = 1.0  # embeddings * m (Granite, Falcon-H1)
    residual_multiplier: float = 1.0  # h + branch * m (Granite)
    logits_multiplier: float = 1.0  # lm_head(h) * m (Granite: 1 / logits_scaling; Falcon-H1 lm_head_multiplier)
    attention: AttentionConfig | None = None
    # Per-layer attention settings, one entry per layer (None: `attention`): LFM3's sliding-window layers' own
    # RoPE, Inkling's sliding layers' own heads (the caches take each layer's KV shape from its kv_specs).
    layer_attention: tuple[AttentionConfig | None, ...] = ()
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None
    mamba1: Mamba1Config | None = None
    mamba2: Mamba2Config | None = None
    gdn: GatedDeltaNetConfig | None = None
    short_conv: ShortConvConfig | None = None
    mla: MLAConfig | None = None  # set: the attention layers are MLA (Kimi-Linear)
    kda: KDAConfig | None = None
    indexed_mla: IndexedMLAConfig | None = None  # "indexed_attention" layers (its indexer "full")
    shared_index_layers: tuple[int, ...] = ()  # indexed layers reusing the previous full layer's selection
    hyper_connections: HyperConnectionConfig | None = None
    gated_residual: GatedResidualConfig | None = None  # Qwen4-Exp's hyper-connections
    gdn_ple: PLEGatedDeltaNetConfig | None = None  # "gdn_ple" layers (Qwen4-Exp's GDN layers with PLE)
    lightning: LightningConfig | None = None
    rglru: RGLRUConfig | None = None  # RecurrentGemma's recurrent blocks
    rwkv: RwkvConfig | None = None  # RWKV-4's layers (time mix + channel mix)
    output_convs: OutputConvsConfig | None = None  # "conv_attention" layers' residual convs (Inkling)
    attention_residual_block: int = 0  # Inkling-2: layers per block of its block attention residuals (0: none)
    xlstm: XlstmConfig | None = None  # xLSTM's layers (mLSTM cell + gated feed-forward)
    cca: CCAConfig | None = None  # Zaya's "cca_attention" layers: their conv windows, value shift, router width
    # MiniMax's residual factors: (full_attn alpha, beta, linear_attn alpha, beta, mlp alpha, beta)
    minimax_factors: tuple[float, float, float, float, float, float] | None = None
    shared_blocks: SharedBlocksConfig | None = None
    post_norms: bool = False  # RMSNorms on the mixer's and the feed-forward's outputs as well (LFM3's sandwich)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    # Per layer: the sliding window (tokens a query sees, itself included) of an attention layer, 0 for full
    # attention and for other layers; () when no layer has one. Window layers form the window cache group.
    attention_windows: tuple[int, ...] = ()
    logits_soft_cap: float | None = None  # logits -> cap * tanh(logits / cap) (RecurrentGemma); None: none
    # Rows of the embedding and head on disk when padded past vocab_size (Inkling); logits past vocab_size are
    # dropped. None: vocab_size rows.
    padded_vocab_size: int | None = None
    # The blocks of one step of the checkpoint's multi-token-prediction head where its config declares one (each
    # block's layer type and mlp type, run in order); () where it declares none. Read only by speculative method
    # "mtp" (model/mtp_load.py); the target's own layers never include them.
    mtp_layer_types: tuple[str, ...] = ()
    mtp_mlp_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.mlp_types):
            raise ValueError("layer_types and mlp_types must have one entry per layer")
        if len(self.mtp_layer_types) != len(self.mtp_mlp_types):
            raise ValueError("mtp_layer_types and mtp_mlp_types must have one entry per MTP block")
        for name in (*self.layer_types, *self.mtp_layer_types):
            if not layer_kind(name).configured(self):
                raise ValueError(f"layer type {name!r} used without its config")
        if self.mla is not None and (self.attention is not None or self.layer_attention or self.attention_windows):
            raise ValueError("MLA attention layers take no AttentionConfig, layer_attention or sliding windows")
        self._check_layer_attention()
        for i in self.shared_index_layers:
            if not 0 <= i < len(self.layer_types) or self.layer_types[i] != "indexed_attention":
                raise ValueError(f"shared_index_layers names layer {i}, not an indexed_attention layer")
        if self.indexed_mla is not None and self.indexed_mla.indexer != "full":
            raise ValueError("indexed_mla is the full layers' config; shared ones are named by shared_index_layers")
        if self.attention_windows:
            if len(self.attention_windows) != len(self.layer_types):
                raise ValueError("attention_windows must have one entry per layer")
            for kind, w in zip(self.layer_types, self.attention_windows):
                if w < 0 or (w and "attention" not in layer_kind(kind).kv):
                    raise ValueError(f"a sliding window ({w}) needs an attention layer, not {kind!r}")
        for kind in (*self.mlp_types, *self.mtp_mlp_types):
            if kind not in MLP_TYPES:
                raise ValueError(f"unknown mlp type {kind!r}")
            if {"none": True, "dense": self.mlp, "moe": self.moe}[kind] is None:
                raise ValueError(f"mlp type {kind!r} used without its config")

    def _check_layer_attention(self) -> None:
        if not self.layer_attention:
            return
        if len(self.layer_attention) != self.num_layers:
            raise ValueError("layer_attention needs one entry per layer")
        for i, a in enumerate(self.layer_attention):
            if a is None:
                continue
            if i not in self.attention_layers or self.attention is None:
                raise ValueError(f"layer_attention[{i}] set on a layer without attention")

    def attention_for(self, layer: int) -> AttentionConfig:
        """The attention settings of layer `layer` (its own entry of `layer_attention`, else `attention`)."""
        own = self.layer_attention[layer] if self.layer_attention else None
        cfg = own or self.attention
        if cfg is None or layer not in self.attention_layers:
            raise ValueError(f"layer {layer} ({self.layer_types[layer]}) has no attention")
        return cfg

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layer_kind(self, layer: int) -> LayerKind:
        return layer_kind(self.layer_types[layer])

    def mixer_configs(self, layer: int) -> tuple[MixerConfig, ...]:
        """The configs of layer `layer`'s token mixers, as its kind says: its attention's (MLA, or its own
        `attention_for`), then its state's."""
        kind = self.layer_kind(layer)
        kv = (self._kv_config(layer, kind),) if kind.holds_kv else ()
        return kv + ((getattr(self, kind.state),) if kind.state is not None else ())

    def _kv_config(self, layer: int, kind: LayerKind) -> MixerConfig:
        if kind.kv == ("indexed_mla",):
            assert self.indexed_mla is not None
            shared = layer in self.shared_index_layers
            return replace(self.indexed_mla, indexer="shared") if shared else self.indexed_mla
        return self.mla if self.mla is not None else self.attention_for(layer)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with paged KV (full or sliding-window attention, MLA)."""
        return tuple(i for i, t in enumerate(self.layer_types) if layer_kind(t).holds_kv)

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        """The recurrent layers, whose states make up a state slot."""
        return tuple(i for i, t in enumerate(self.layer_types) if layer_kind(t).holds_state)

    def window_of(self, layer: int) -> int:
        """The sliding window of attention layer `layer` (0: full attention)."""
        return self.attention_windows[layer] if self.attention_windows else 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Attention layers of the KV group (no window)."""
        return tuple(i for i in self.attention_layers if not self.window_of(i))

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Sliding-window attention layers: the window group, with its own block pool."""
        return tuple(i for i in self.attention_layers if self.window_of(i))

    @property
    def sliding_window(self) -> int:
        """The widest window of the window group (0: no group); the core keeps that much for every layer."""
        return max((self.window_of(i) for i in self.window_layers), default=0)

    @property
    def has_attention(self) -> bool:
        return bool(self.attention_layers)

    @property
    def has_ssm(self) -> bool:
        return bool(self.ssm_layers)

    def state_specs(self, layer: int) -> tuple[StateTensorSpec, ...]:
        """The named tensors one state slot holds for recurrent layer `layer` (declared by its kind's config)."""
        if not self.layer_kind(layer).holds_state:
            raise ValueError(f"layer {layer} ({self.layer_types[layer]}) has no recurrent state")
        return check_specs(tuple(spec for cfg in self.mixer_configs(layer) for spec in cfg.state_specs()))

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one state slot: every state tensor of every recurrent layer (conv windows in `dtype`)."""
        return sum(spec.nbytes(dtype) for i in self.ssm_layers for spec in self.state_specs(i))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K + V for one token across every full-attention layer (the KV group)."""
        return sum(self._kv_bytes(i, dtype) for i in self.full_attention_layers)

    def window_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K + V for one token across every sliding-window layer (the window group)."""
        return sum(self._kv_bytes(i, dtype) for i in self.window_layers)

    def kv_specs(self, layer: int) -> KVSpecs:
        """The paged tensors attention layer `layer` caches per token (its own K and V, or MLA's latent and
        rope key)."""
        if not self.layer_kind(layer).holds_kv:
            raise ValueError(f"layer {layer} ({self.layer_types[layer]}) has no attention")
        return tuple(spec for cfg in self.mixer_configs(layer) for spec in cfg.kv_specs())

    def _kv_bytes(self, layer: int, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for _, shape in self.kv_specs(layer)) * dtype.itemsize

    def flops_per_token(self) -> float:
        """Approximate prefill FLOPs per token: 2 x the weights every token multiplies (routed experts only)."""
        h, weights = self.hidden_size, 0
        for i, mlp in enumerate(self.mlp_types):
            weights += sum(cfg.flops_weights(h) for cfg in self.mixer_configs(i))
            ffn = {"dense": self.mlp, "moe": self.moe}.get(mlp)
            weights += ffn.flops_weights(h) if ffn is not None else 0
        weights += h * self.vocab_size
        return 2.0 * weights
