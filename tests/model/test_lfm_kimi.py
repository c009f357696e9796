"""LFM2 / LFM2-MoE / LFM3 configs: the translation (layer kinds, windows, per-layer attention, MoE routing) and
the short-conv state kind's bytes (a checkpoint is the conv window alone)."""

from __future__ import annotations

import pytest
import torch

from recap.model.cache import ModelCaches
from recap.model.config import UnsupportedArchitectureError, load_config, read_hf_config, translate_config


def test_lfm2_translation(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("lfm2"))
    assert cfg.layer_types == ("short_conv", "attention", "short_conv", "short_conv")
    assert cfg.mlp_types == ("dense",) * 4 and cfg.tie_word_embeddings and not cfg.post_norms
    assert cfg.mlp is not None and cfg.mlp.intermediate_size == 256  # int(2 * 128 / 3) = 85, rounded up to 256
    a = cfg.attention
    assert a is not None and a.qk_norm and not a.output_gate and (a.rotary_dim, a.rope_angles) == (16, None)
    assert cfg.short_conv is not None and (cfg.short_conv.dim, cfg.short_conv.kernel) == (64, 3)
    assert cfg.window_layers == () and cfg.sliding_window == 0
    # One slot: 3 short-conv layers x 64 channels x (K - 1 = 2) inputs, no matrix state.
    assert cfg.state_bytes_per_slot(torch.float32) == 3 * 64 * 2 * 4
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 2 * 16 * 4


def test_lfm3_translation_windows_and_rope(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("lfm3"))
    assert cfg.layer_types == ("short_conv", "attention", "short_conv", "attention") and cfg.post_norms
    assert cfg.attention_windows == (0, 0, 0, 12) and cfg.sliding_window == 12
    assert cfg.full_attention_layers == (1,) and cfg.window_layers == (3,)
    full, window = cfg.attention_config(1), cfg.attention_config(3)
    assert full.output_gate and full.rope_theta == 1e6 and full.rope_angles == 4  # proportional: 0.5 * 16 // 2
    assert window.rope_theta == 10000.0 and window.rope_angles is None
    assert cfg.kv_bytes_per_token(torch.float32) == cfg.window_bytes_per_token(torch.float32) == 2 * 2 * 16 * 4
    caches = ModelCaches.allocate(cfg, num_kv_blocks=5, block_size=16, num_state_slots=2, dtype=torch.float32)
    assert set(caches.kv) == {1} and set(caches.window) == {3} and caches.window[3].k_cache.shape[0] == 5
    assert cfg.state_bytes_per_slot(torch.float32) == 2 * 64 * 4 * 4  # 2 conv layers x 64 x (5 - 1) taps


def test_lfm2_moe_translation(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("lfm2_moe"))
    assert cfg.mlp_types == ("dense", "moe", "moe", "moe")
    m = cfg.moe
    assert m is not None and (m.num_experts, m.top_k, m.intermediate_size) == (4, 2, 32)
    assert (m.scoring, m.renormalize, m.correction_bias) == ("sigmoid", True, True)


def test_lfm_refuses_what_it_cannot_run(tiny_checkpoint) -> None:  # noqa: ANN001
    raw = read_hf_config(tiny_checkpoint("lfm3"))
    with pytest.raises(UnsupportedArchitectureError, match="rope_type"):
        rope = {**raw["rope_parameters"], "full_attention": {"rope_type": "yarn"}}
        translate_config({**raw, "rope_parameters": rope})
    with pytest.raises(UnsupportedArchitectureError, match="sliding_window"):
        translate_config({**raw, "sliding_window": None})
    with pytest.raises(UnsupportedArchitectureError, match="layer_types"):
        translate_config({**raw, "layer_types": ["conv", "mamba", "conv", "conv"]})
