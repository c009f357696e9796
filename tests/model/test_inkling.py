"""Inkling's translator reads hub-shaped config.json as InklingTextConfig does (derived layer pattern, leading
dense layers, `dense_intermediate_size`, the `sconv_kernel_size` alias, a padded head) and refuses what
transformers cannot run."""

from __future__ import annotations

import pytest
import torch

from recap.model.config import UnsupportedArchitectureError, translate_config

_HUB_TEXT = {"vocab_size": 1024, "unpadded_vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 7,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4,
             "swa_num_key_value_heads": 1, "swa_head_dim": 8, "sliding_window_size": 12, "d_rel": 4,
             "rel_extent": 20, "dense_mlp_idx": 2, "intermediate_size": 32, "dense_intermediate_size": 96,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2, "sconv_kernel_size": 3,
             "logits_mup_width_multiplier": 4.0}  # fmt: skip


def test_hub_text_config_reads_as_transformers_does() -> None:
    import transformers

    hf = transformers.InklingTextConfig(**_HUB_TEXT)
    cfg = translate_config({"architectures": ["InklingForCausalLM"], **_HUB_TEXT})
    windows = tuple(12 if t == "hybrid_sliding" else 0 for t in hf.layer_types)
    assert cfg.attention_windows == windows and windows.count(0) == 1  # every sixth layer is full
    assert cfg.mlp_types == tuple("dense" if t == "dense" else "moe" for t in hf.mlp_layer_types)
    assert cfg.mlp_types[:3] == ("dense", "dense", "moe")
    assert cfg.mlp is not None and cfg.mlp.intermediate_size == hf.intermediate_size == 96
    assert cfg.moe is not None and cfg.moe.intermediate_size == hf.moe_intermediate_size == 32
    assert cfg.output_convs is not None and cfg.output_convs.kernel == hf.conv_kernel_size == 3
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.logits_multiplier) == (1000, 1024, 0.25)
    full, sliding = cfg.attention_for(5), cfg.attention_for(0)
    assert (full.num_kv_heads, full.head_dim, full.rel_extent) == (2, 16, 20)  # type: ignore[attr-defined]
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.rel_extent) == (1, 8, 12)  # type: ignore[attr-defined]
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 2 * 16 * 4  # K and V of the one full layer
    assert cfg.window_bytes_per_token(torch.float32) == 6 * 2 * 1 * 8 * 4  # of the six sliding ones


def test_the_wrapper_reads_its_text_config() -> None:
    raw = {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
           "text_config": _HUB_TEXT, "vision_config": {}, "audio_config": {}}  # fmt: skip
    cfg = translate_config(raw)
    assert cfg.architecture == "InklingForConditionalGeneration" and cfg.num_layers == 7
    assert cfg.mlp is not None and cfg.mlp.fused_gate_up and cfg.mlp.interleaved_gate_up
    assert cfg.moe is not None and cfg.moe.interleaved_gate_up and cfg.moe.shared_sink == 2


def test_no_shared_expert_is_refused() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="n_shared_experts"):
        translate_config({"architectures": ["InklingForCausalLM"], **_HUB_TEXT, "n_shared_experts": 0})


def test_inkling2_hub_text_config_reads_as_transformers_does() -> None:
    import transformers

    raw = {"vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1,
           "swa_head_dim": 8, "unpadded_vocab_size": 1000, "intermediate_size": 48, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "routed_scaling_factor": 2.5}  # fmt: skip
    hf = transformers.Inkling2TextConfig(**raw)
    cfg = translate_config({"architectures": ["Inkling2ForCausalLM"], **raw})
    assert cfg.attention_windows == tuple(hf.sliding_window_size if t == "hybrid_sliding" else 0
                                          for t in hf.layer_types)  # fmt: skip
    assert cfg.attention_windows.count(0) == 1 and cfg.attention_residual_block == hf.n_layers_per_attn_res_block
    assert cfg.moe is not None and cfg.moe.intermediate_size == hf.moe_intermediate_size == 48
    assert cfg.moe.routed_scaling_factor == hf.route_scale == 2.5 and cfg.moe.softcaps == (4.0, 25.0)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.logits_soft_cap) == (1000, 1024, 30.0)
    full = cfg.attention_for(5)
    assert full.dynamic_kv and full.log_scaling_floor == hf.log_scaling_n_floor  # type: ignore[attr-defined]
    assert full.softmax_scale == 16**-0.5 and not cfg.attention_for(0).dynamic_kv  # type: ignore[attr-defined]
