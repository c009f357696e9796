"""LFM2 / LFM2-MoE / LFM3 and Kimi-Linear configs: the translation (layer kinds, windows, per-layer attention,
MoE routing), the state kinds' bytes (short conv: the conv window alone; KDA: three windows + a matrix), MLA's
per-layer KV spec (latent + rope key), and Kimi-Linear variants against transformers."""

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
    assert a is not None and a.qk_norm == "head" and not a.head_gate and (a.rotary_dim, a.rope_angles) == (16, None)
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
    full, window = cfg.attention_for(1), cfg.attention_for(3)
    assert full.head_gate and full.rope_theta == 1e6 and full.rope_angles == 4  # proportional: 0.5 * 16 // 2
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


def test_kimi_translation(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("kimi_linear"))
    assert cfg.layer_types == ("kda", "attention") * 2 and cfg.mlp_types == ("dense", "moe", "moe", "moe")
    assert cfg.mla is not None and cfg.attention is None and cfg.kda is not None
    m = cfg.moe
    assert m is not None and (m.scoring, m.correction_bias, m.renormalize, m.shared_intermediate_size) == (
        "sigmoid", True, True, 32)
    # MLA caches the latent (16) and the rope key (8) per token, not K and V of 4 heads (2 x 4 x 24).
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * (16 + 8) * 4
    caches = ModelCaches.allocate(cfg, num_kv_blocks=3, block_size=16, num_state_slots=2, dtype=torch.float32)
    assert set(caches.kv[1].tensors) == {"latent", "rope"} and caches.kv[1].tensors["latent"].shape == (3, 16, 1, 16)
    # A KDA slot: three conv windows (64 channels x 3) in the model dtype + a 4 x 16 x 16 fp32 state.
    assert set(caches.state[0].tensors) == {"conv_q", "conv_k", "conv_v", "recurrent"}
    assert cfg.state_bytes_per_slot(torch.bfloat16) == 2 * (3 * 64 * 3 * 2 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("overrides", [{"q_lora_rank": 12}, {"n_group": 2, "topk_group": 1}])
def test_kimi_variants_match_transformers(overrides: dict, tmp_path) -> None:  # noqa: ANN001
    """The low-rank query path and grouped routing, against transformers' no-cache forward."""
    from transformers import AutoModelForCausalLM

    from recap.backends import prepare
    from recap.kernels.metadata import SeqSpec
    from recap.model.loader import load_model
    from recap.model.testing import forward_step, make_tiny_checkpoint

    path = make_tiny_checkpoint("kimi_linear", tmp_path, **overrides)
    lm = load_model(path)
    prepare(lm)
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0].float()
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)])
    logits = lm.model.compute_logits(hidden)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
