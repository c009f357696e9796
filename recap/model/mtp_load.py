"""Read a checkpoint's multi-token-prediction head (`mtp.*`) for speculative method "mtp".

The target model's own load skips `mtp.*` (its `ignored_checkpoint_prefixes`); asking for MTP speculation reads
them here into an MTPHead (model/layers/mtp.py), strictly: every head weight present, no unexpected key.
Families with an MTP head: Qwen3.5 / 3.6 (dense and MoE) and Qwen3-Next."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from recap.model.layers.mtp import MTPHead
from recap.model.layers.norm import OffsetRMSNorm
from recap.model.loader import WeightLoadError, _copy_checked, iter_checkpoint
from recap.model.model_config import ModelConfig
from recap.model.models.qwen3_5 import Qwen3_5Block, Qwen3_5ForCausalLM

MTP_PREFIX = "mtp."


class MTPWeightsMissingError(ValueError):
    """Speculative method "mtp" asked of a checkpoint without an MTP head (or of a family recap has none for)."""


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The head's own config: one full-attention layer (index 0) with the target's attention settings and the
    feed-forward kind of the target's last layer (a MoE in a MoE model)."""
    last = config.num_layers - 1
    attention = config.attention_for(max(config.full_attention_layers, default=last))
    return replace(config, layer_types=("attention",), mlp_types=(config.mlp_types[last],), layer_attention=(),
                   attention=attention, attention_windows=())  # fmt: skip


def build_mtp_head(config: ModelConfig, dtype: torch.dtype) -> MTPHead:
    head_config = mtp_layer_config(config)
    block = Qwen3_5Block(head_config, 0, dtype)
    return MTPHead(config.hidden_size, block, OffsetRMSNorm, config.norm_eps, dtype)


def load_mtp_head(path: Path, target: torch.nn.Module, config: ModelConfig, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> MTPHead:  # fmt: skip
    """The checkpoint's `mtp.*` weights as an MTPHead on `device` (MTPWeightsMissingError where there are none;
    WeightLoadError for a missing, unexpected or misshapen one)."""
    if not isinstance(target, Qwen3_5ForCausalLM):
        raise MTPWeightsMissingError(f"speculative method 'mtp': recap reads MTP heads of Qwen3.5 / Qwen3-Next "
                                     f"checkpoints, not of {config.architecture}")  # fmt: skip
    head = build_mtp_head(config, dtype)
    params = head.state_dict(keep_vars=True)
    seen: set[str] = set()
    layers: set[str] = set()
    for stored, f, shard in iter_checkpoint(path):
        if not stored.key.startswith(MTP_PREFIX):
            continue
        key = stored.key.removeprefix(MTP_PREFIX)
        if key.startswith("layers."):
            layers.add(key.split(".")[1])
        if key not in params or key in seen:
            if len(layers) > 1:
                raise WeightLoadError(f"{path}: an MTP head of {len(layers)} layers; recap reads heads of one")
            raise WeightLoadError(f"unexpected or duplicate MTP key {stored.key!r} in {shard}")
        _copy_checked(f, stored, params[key], shard)
        seen.add(key)
    if not seen:
        raise MTPWeightsMissingError(f"speculative method 'mtp': {path} holds no MTP head (no `mtp.*` weights)")
    missing = sorted(set(params) - seen)
    if missing:
        raise WeightLoadError(f"{path}: MTP head weights missing: {', '.join('mtp.' + k for k in missing[:5])}")
    return head.to(device).eval()
