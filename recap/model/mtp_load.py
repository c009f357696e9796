"""Read a checkpoint's multi-token-prediction head for speculative method "mtp".

The config declares the head's blocks (ModelConfig.mtp_layer_types / mtp_mlp_types, from the translator); the
family builds them with its own block class (`build_layers` over the head's config) and names where each head
weight lives on disk (`CausalLM.mtp_weight_name`). The target's own load skips those keys; asking for MTP
speculation reads them here into an MTPHead (model/layers/mtp.py), strictly: every head weight present, no
unexpected key under the head's names. Families with a head: Qwen3.5 / 3.6 and Qwen3-Next (`mtp.*`), Nemotron-H
and Nemotron-3 (`mtp.layers.*`), Ling 3.0 (DeepSeek-V3 style, `model.layers.{N}.*`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from recap.model.layers.mtp import MTPHead
from recap.model.loader import WeightLoadError, _copy_checked, iter_checkpoint
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM

logger = logging.getLogger(__name__)


class MTPWeightsMissingError(ValueError):
    """Speculative method "mtp" asked of a checkpoint without an MTP head (or of a family recap has none for)."""


class UnsupportedMTPHeadError(ValueError):
    """The config declares an MTP head recap cannot run as a drafter (a recurrent block: it would need state
    slots the drafter does not keep)."""


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The head's own config: its blocks as the layers 0..B-1, with the target's settings (the attention of the
    target's last full-attention layer, for a family whose layers differ)."""
    if not config.mtp_layer_types:
        raise MTPWeightsMissingError(f"speculative method 'mtp': {config.architecture}'s config declares no "
                                     f"multi-token-prediction layers")  # fmt: skip
    attention = config.attention
    if config.layer_attention and config.full_attention_layers:
        attention = config.attention_for(max(config.full_attention_layers))
    head = replace(config, layer_types=config.mtp_layer_types, mlp_types=config.mtp_mlp_types, layer_attention=(),
                   attention=attention, attention_windows=(), shared_index_layers=(), mtp_layer_types=(),
                   mtp_mlp_types=())  # fmt: skip
    if head.ssm_layers:  # the drafter keeps K/V blocks only, no state slots
        raise UnsupportedMTPHeadError(f"speculative method 'mtp': {config.architecture}'s MTP head has recurrent "
                                      f"blocks {config.mtp_layer_types}; recap drafts with attention-only heads")
    return head


def build_mtp_head(target: CausalLM, dtype: torch.dtype) -> MTPHead:
    """The head's modules, uninitialised: the family's blocks for the head's config, the norms of its final norm's
    class."""
    config = target.config
    head_config = mtp_layer_config(config)
    blocks = target.build_layers(head_config, dtype)
    return MTPHead(config.hidden_size, blocks, type(target.final_norm()), config.norm_eps, dtype)


def load_mtp_head(path: Path, target: CausalLM, config: ModelConfig, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> MTPHead:  # fmt: skip
    """The checkpoint's MTP head weights as an MTPHead on `device` (MTPWeightsMissingError where there are none;
    WeightLoadError for a missing, unexpected or misshapen one). Logs what it read."""
    head = build_mtp_head(target, dtype)
    params = head.state_dict(keep_vars=True)
    seen: set[str] = set()
    for stored, f, shard in iter_checkpoint(path):
        key = target.mtp_weight_name(stored.key)
        if key is None:
            continue
        if key not in params or key in seen:
            raise WeightLoadError(f"unexpected or duplicate MTP key {stored.key!r} in {shard} (the head built from "
                                  f"the config has blocks {config.mtp_layer_types})")  # fmt: skip
        _copy_checked(f, stored, params[key], shard)
        seen.add(key)
    if not seen:
        raise MTPWeightsMissingError(f"speculative method 'mtp': {path} holds no MTP head weights "
                                     f"({config.architecture})")  # fmt: skip
    missing = sorted(set(params) - seen)
    if missing:
        raise WeightLoadError(f"{path}: MTP head weights missing: {', '.join(missing[:5])}")
    logger.info("%s: read the MTP head (%d tensors; blocks %s)", path, len(seen),
                ", ".join(f"{t}/{m}" for t, m in zip(config.mtp_layer_types, config.mtp_mlp_types)))  # fmt: skip
    return head.to(device).eval()
