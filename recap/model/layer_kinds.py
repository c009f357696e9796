"""The normalized layer types (`ModelConfig.layer_types`) as one table: what configures each and what it caches.

A row names ModelConfig fields:
- `kv`: the fields that can configure the layer's attention (one must be set; `mla` stands for `attention`
  model-wide): the layer holds paged KV, the window group's when it has a sliding window;
- `state`: the field whose config declares the layer's part of a state slot (state_spec.py).
A layer with exactly one config has a single token mixer, the layer class that config names
(`MixerConfig.mixer`), built by `build_mixer`; the two mixers of a "hybrid" layer and the feed-forward of a
"none" layer are laid out by the family's model file.
A new recurrent kind: its config class (mixer_configs.py) with its mixer and kernels, a ModelConfig field
and a row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from recap.model.mixer_configs import MixerConfig

if TYPE_CHECKING:
    from recap.model.model_config import ModelConfig


@dataclass(frozen=True)
class LayerKind:
    name: str
    kv: tuple[str, ...] = ()  # () : no KV
    state: str | None = None  # None: no part of the state slot

    @property
    def holds_kv(self) -> bool:
        return bool(self.kv)

    @property
    def holds_state(self) -> bool:
        return self.state is not None

    def configured(self, config: ModelConfig) -> bool:
        """Whether `config` sets what a layer of this kind needs."""
        kv = not self.kv or any(getattr(config, f) is not None for f in self.kv)
        return kv and (self.state is None or getattr(config, self.state) is not None)


LAYER_KINDS: dict[str, LayerKind] = {
    kind.name: kind
    for kind in (
        LayerKind("mamba1", state="mamba1"),
        LayerKind("mamba2", state="mamba2"),
        LayerKind("attention", kv=("attention", "mla")),  # softmax attention (sliding-window or full) or MLA
        LayerKind("gdn", state="gdn"),  # Gated DeltaNet
        LayerKind("none"),  # no mixer: an MLP/MoE-only layer (Nemotron-H)
        # attention AND a Mamba2 state in one layer: Falcon-H1's parallel mixers, Zamba2's shared-block layers
        LayerKind("hybrid", kv=("attention",), state="mamba2"),
        LayerKind("hybrid_mamba1", kv=("attention",), state="mamba1"),  # Zamba's shared-block layers
        LayerKind("short_conv", state="short_conv"),  # LFM2's gated short convolution: the conv window alone
        LayerKind("kda", state="kda"),  # Kimi Delta Attention
        # MLA over the keys a DSA-style indexer selects (GLM-5.3-Flash); the indexer's keys share the KV blocks
        LayerKind("indexed_attention", kv=("indexed_mla",)),
        LayerKind("lightning", state="lightning"),  # MiniMax lightning attention (on the SSD kernels)
        LayerKind("rglru", state="rglru"),  # Griffin's recurrent block (RecurrentGemma): conv window + RG-LRU state
        LayerKind("gdn_ple", state="gdn_ple"),  # Gated DeltaNet + Qwen4-Exp's per-layer n-gram embeddings
        LayerKind("rwkv", state="rwkv"),  # RWKV-4's time mix + channel mix: two shifts + WKV
        # Inkling: attention whose K/V pass short convs, and short convs on the attention and feed-forward
        # outputs; its slot part: those four conv windows (two declared by its attention config)
        LayerKind("conv_attention", kv=("attention",), state="output_convs"),
        LayerKind("mlstm", state="xlstm"),  # xLSTM's mLSTM cell (C, n, m per head) + its feed-forward
        # Zaya: attention whose q/k pass two stacked convs and whose values take half from the previous token;
        # its slot part: the q/k conv window and the token shift (its `cca` config)
        LayerKind("cca_attention", kv=("attention",), state="cca"),
    )
}
LAYER_TYPES = tuple(LAYER_KINDS)


def layer_kind(name: str) -> LayerKind:
    kind = LAYER_KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown layer type {name!r}")
    return kind


def mixer_class(cfg: MixerConfig) -> type[nn.Module]:
    """The layer class `cfg` configures (imported on first use: configs never import layers)."""
    module, name = cfg.mixer.split(":")
    return getattr(importlib.import_module(module), name)


def build_mixer(config: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    """The token mixer of a single-mixer layer (every kind with one config: "attention" (or MLA), "mamba1",
    "mamba2", "gdn", "kda", "short_conv")."""
    kind = config.layer_kind(layer)
    configs = config.mixer_configs(layer)
    if len(configs) != 1:
        raise ValueError(f"layer {layer}: layer type {kind.name!r} has no single mixer")
    extra: dict[str, int | None] = {"window": config.window_of(layer)} if kind.holds_kv else {}
    if configs[0].per_layer:
        extra["layer"] = layer
    return mixer_class(configs[0])(config.hidden_size, configs[0], dtype, **extra)
