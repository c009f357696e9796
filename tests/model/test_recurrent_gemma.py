"""RecurrentGemma's config translation: the tiny checkpoint's, the hub's config.json shapes, and refusals."""

from __future__ import annotations

import pytest
import torch

from recap.model.config import UnsupportedArchitectureError, load_config, translate_config

# google/recurrentgemma-2b's config.json (9b: hidden 4096, 38 layers, 16 heads, lru_width 4096, 12288 x 3)
HUB_2B = {
    "architectures": ["RecurrentGemmaForCausalLM"], "model_type": "recurrent_gemma", "attention_bias": False,
    "attention_window_size": 2048, "block_types": ["recurrent", "recurrent", "attention"], "bos_token_id": 2,
    "conv1d_width": 4, "embeddings_scale_by_sqrt_dim": True, "eos_token_id": 1, "final_w_init_variance_scale": 0.0769,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2560, "intermediate_size": 15360,
    "logits_soft_cap": 30.0, "lru_width": 2560, "num_attention_heads": 10, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "vocab_size": 256000, "w_init_variance_scale": 0.01,
}  # fmt: skip


def test_tiny_checkpoint_config(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("recurrent_gemma"))
    assert cfg.layer_types == ("rglru", "rglru", "attention", "rglru") and cfg.mlp_types == ("dense",) * 4
    assert cfg.window_layers == (2,) and cfg.full_attention_layers == () and cfg.sliding_window == 12
    r = cfg.rglru
    assert r is not None and (r.lru_width, r.num_heads, r.block_width, r.conv_kernel) == (64, 4, 16, 4)
    assert [(s.name, s.shape, s.dtype) for s in cfg.state_specs(0)] == [
        ("conv", (64, 3), None), ("rglru", (64,), torch.float32)]  # fmt: skip
    assert cfg.state_bytes_per_slot(torch.bfloat16) == 3 * (64 * 3 * 2 + 64 * 4)
    a = cfg.attention
    assert a is not None and (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim) == (4, 2, 16, 8)
    assert (a.bias, a.o_bias, a.rope_theta) == (False, True, 10000.0)
    assert cfg.mlp is not None and (cfg.mlp.intermediate_size, cfg.mlp.bias) == (64, True)
    assert (cfg.embedding_multiplier, cfg.logits_soft_cap, cfg.tie_word_embeddings) == (8.0, 30.0, True)


def test_hub_config_2b() -> None:
    cfg = translate_config(HUB_2B)
    assert cfg.num_layers == 26 and cfg.layer_types[:3] == ("rglru", "rglru", "attention")
    assert cfg.layer_types[24:] == ("rglru", "rglru") and len(cfg.window_layers) == 8
    assert cfg.sliding_window == 2048 and cfg.attention_windows[2] == 2048
    a = cfg.attention
    assert a is not None and (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim) == (10, 1, 256, 128)
    assert cfg.rglru is not None and (cfg.rglru.lru_width, cfg.rglru.block_width) == (2560, 256)
    assert cfg.mlp is not None and cfg.mlp.intermediate_size == 7680 and cfg.mlp.activation == "gelu_pytorch_tanh"
    assert cfg.embedding_multiplier == 50.5  # sqrt(2560) = 50.596 in bfloat16, as transformers' normalizer
    assert cfg.logits_soft_cap == 30.0 and cfg.eos_token_id == 1
    # a slot: 18 recurrent layers x (conv window 2560 x 3 in bf16 + the fp32 state)
    assert cfg.state_bytes_per_slot(torch.bfloat16) == 18 * (2560 * 3 * 2 + 2560 * 4)


def test_defaults_and_refusals() -> None:
    bare = {k: v for k, v in HUB_2B.items() if k not in ("block_types", "lru_width", "partial_rotary_factor",
                                                         "logits_soft_cap", "attention_window_size")}  # fmt: skip
    cfg = translate_config(bare)  # transformers' defaults: the r, r, a pattern, lru = hidden, half-rotary heads
    assert cfg.layer_types[:3] == ("rglru", "rglru", "attention") and cfg.sliding_window == 2048
    assert cfg.rglru is not None and cfg.rglru.lru_width == 2560
    assert cfg.attention is not None and cfg.attention.rotary_dim == 128 and cfg.logits_soft_cap == 30.0
    with pytest.raises(ValueError, match="block_types"):
        translate_config({**HUB_2B, "block_types": ["recurrent", "mlp"]})
    with pytest.raises(UnsupportedArchitectureError, match="rope_type"):
        translate_config({**HUB_2B, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="gate blocks"):
        translate_config({**HUB_2B, "lru_width": 2565})
