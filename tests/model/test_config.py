"""HF config.json -> ModelConfig for every supported family, and the byte-size helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from recap.model.cache import ModelCaches
from recap.model.config import UnsupportedArchitectureError, load_config, read_hf_config, translate_config
from recap.model.testing import TINY_ARCHS

EXPECTED_LAYERS = {
    "mamba": (("mamba1",) * 2, ("none",) * 2),
    "falcon_mamba": (("mamba1",) * 2, ("none",) * 2),
    "mamba2": (("mamba2",) * 2, ("none",) * 2),
    "bamba": (("mamba2", "attention", "mamba2", "mamba2"), ("dense",) * 4),
    "jamba": (("mamba1", "attention", "mamba1", "attention"), ("dense", "moe", "dense", "moe")),
}


@pytest.mark.parametrize("arch", EXPECTED_LAYERS)  # LFM and Kimi-Linear: tests/model/test_lfm_kimi.py
def test_translate_tiny_checkpoint_configs(arch, tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint(arch))
    assert cfg.architecture == TINY_ARCHS[arch]
    assert (cfg.layer_types, cfg.mlp_types) == EXPECTED_LAYERS[arch]
    assert cfg.hidden_size == 64 and cfg.vocab_size == 512
    assert cfg.tie_word_embeddings == (arch in ("mamba", "falcon_mamba"))
    if cfg.mamba1 is not None:
        m1 = cfg.mamba1
        assert (m1.d_inner, m1.d_state, m1.d_conv, m1.dt_rank) == (128, 16, 4, 4)
        assert m1.bcdt_norm == {"mamba": "none", "falcon_mamba": "plain", "jamba": "weighted"}[arch]
    if cfg.mamba2 is not None:
        m2 = cfg.mamba2
        assert (m2.num_heads, m2.head_dim, m2.n_groups, m2.d_state, m2.chunk_size) == (8, 16, 2, 16, 32)
        assert m2.conv_dim == 192 and m2.in_proj_dim == 328  # HF_NOTES' layouts
        assert m2.time_step_limit == (0.0, math.inf)
        assert cfg.ssm_chunk_size == 32
    if cfg.attention is not None:
        a = cfg.attention
        assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
        assert (a.rope_theta, a.rotary_dim) == ((10000.0, 8) if arch == "bamba" else (None, 0))
    if arch == "jamba":
        assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (4, 2)
        assert (cfg.moe.scoring, cfg.moe.renormalize, cfg.moe.shared_intermediate_size) == ("softmax", False, 0)


@pytest.mark.parametrize("encoding", ['{"__float__": "Infinity"}', "Infinity", '"Infinity"', "1e9"])
def test_time_step_limit_encodings(encoding, tiny_checkpoint) -> None:  # noqa: ANN001
    raw = read_hf_config(tiny_checkpoint("mamba2"))
    raw.pop("time_step_limit")
    text = json.dumps(raw)[:-1] + f', "time_step_limit": [0.001, {encoding}]}}'
    cfg = translate_config(json.loads(text))
    assert cfg.mamba2 is not None
    assert cfg.mamba2.time_step_limit == (0.001, 1e9 if encoding == "1e9" else math.inf)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as e:
        translate_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg
    for name in TINY_ARCHS.values():
        assert name in msg


def test_model_type_fallback_and_jamba_pattern() -> None:
    cfg = translate_config({
        "model_type": "jamba", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
        "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 8, "num_experts_per_tok": 2, "mamba_dt_rank": "auto",
    })  # fmt: skip
    assert cfg.architecture == "JambaForCausalLM"
    assert cfg.attention_layers == (2, 6)
    assert cfg.mlp_types == ("dense", "moe") * 4
    assert cfg.mamba1 is not None and cfg.mamba1.dt_rank == 2  # ceil(32 / 16)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_helpers_match_allocated_caches(arch, dtype, tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint(arch))
    caches = ModelCaches.allocate(cfg, num_kv_blocks=3, block_size=16, num_state_slots=2, dtype=dtype)
    assert cfg.state_bytes_per_slot(dtype) == caches.state_bytes_per_slot()
    assert cfg.kv_bytes_per_token(dtype) == caches.kv_bytes_per_token()
    assert cfg.window_bytes_per_token(dtype) == caches.window_bytes_per_token()
    for i, st in caches.state.items():  # conv windows in the model dtype, SSM states in fp32
        assert [t.dtype for t in st.tensors.values()] == [spec.resolve_dtype(dtype) for spec in cfg.state_specs(i)]
        assert all(t.dtype == torch.float32 for n, t in st.tensors.items() if n == "ssm")
    assert (cfg.kv_bytes_per_token(dtype) + cfg.window_bytes_per_token(dtype) > 0) == cfg.has_attention
    if arch == "mamba2":  # 2 layers x (conv 192 x 3 in dtype + ssm 8 x 16 x 16 in fp32)
        assert cfg.state_bytes_per_slot(dtype) == 2 * (192 * 3 * dtype.itemsize + 8 * 16 * 16 * 4)
    if arch == "bamba":  # 1 attention layer x K+V x 2 heads x 16
        assert cfg.kv_bytes_per_token(dtype) == 2 * 2 * 16 * dtype.itemsize
