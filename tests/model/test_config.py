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
    "nemotron_h": (("mamba2", "none", "attention", "none", "mamba2", "none"),
                   ("none", "moe", "none", "dense", "none", "moe")),
    "granite_hybrid": (("mamba2", "attention", "mamba2", "mamba2"), ("moe",) * 4),
    "falcon_h1": (("hybrid",) * 3, ("dense",) * 3),
    "qwen3_5": (("gdn", "attention") * 2, ("dense",) * 4),
    "qwen3_5_moe": (("gdn", "attention") * 2, ("moe",) * 4),
    "qwen3_next": (("gdn", "attention") * 2, ("moe", "moe", "dense", "moe")),  # layer 2 in mlp_only_layers
    "qwen3_5_vl": (("gdn", "attention") * 2, ("dense",) * 4),
    "qwen3_5_moe_vl": (("gdn", "attention") * 2, ("moe",) * 4),
    "olmo_hybrid": (("gdn", "attention") * 2, ("dense",) * 4),
    "zamba2": (("mamba2", "hybrid", "mamba2", "hybrid", "hybrid"), ("none", "dense", "none", "dense", "dense")),
    "minimax": (("lightning", "attention", "lightning", "lightning"), ("moe",) * 4),
    "zamba": (("mamba1", "hybrid_mamba1", "mamba1", "hybrid_mamba1", "hybrid_mamba1"),
              ("none", "dense", "none", "dense", "dense")),
}
# (theta, rotary dims); the others have no RoPE
ROPE = {"minimax": (1e6, 16), "bamba": (10000.0, 8), "falcon_h1": (10000.0, 16), "zamba2": (10000.0, 32)}


@pytest.mark.parametrize("arch", EXPECTED_LAYERS)  # LFM and Kimi-Linear: tests/model/test_lfm_kimi.py
def test_translate_tiny_checkpoint_configs(arch, tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint(arch))
    assert cfg.architecture == TINY_ARCHS[arch]
    assert (cfg.layer_types, cfg.mlp_types) == EXPECTED_LAYERS[arch]
    assert cfg.hidden_size == 64 and cfg.vocab_size == 512
    assert cfg.tie_word_embeddings == (arch in ("mamba", "falcon_mamba", "zamba2", "zamba"))
    if cfg.mamba1 is not None:
        m1 = cfg.mamba1
        assert (m1.d_inner, m1.d_state, m1.d_conv, m1.dt_rank) == (128, 16, 4, 4)
        assert m1.bcdt_norm == {"falcon_mamba": "plain", "jamba": "weighted"}.get(arch, "none")
        assert getattr(m1, "num_heads", 1) == (2 if arch == "zamba" else 1)  # Zamba's multi-head Mamba1
    if cfg.mamba2 is not None:
        m2 = cfg.mamba2
        assert (m2.num_heads, m2.head_dim, m2.n_groups, m2.d_state, m2.chunk_size) == (8, 16, 2, 16, 32)
        assert m2.conv_dim == 192 and m2.in_proj_dim == 328  # HF_NOTES' layouts
        # transformers' Nemotron-H clamps dt at time_step_min, whatever time_step_limit says
        assert m2.time_step_limit == ((0.001 if arch in ("nemotron_h", "zamba2") else 0.0), math.inf)
        assert cfg.ssm_chunk_size == 32
    if cfg.attention is not None:
        a = cfg.attention
        if "zamba" in arch:  # attention over [h | embeddings]: 2 x hidden wide, scaled by sqrt(head_dim / 2)
            assert (a.num_heads, a.num_kv_heads, a.head_dim, a.input_size, a.softmax_scale) == (4, 4, 32, 128, 0.25)
        else:
            assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
        qwen = "qwen" in arch
        rope = {**ROPE, "olmo_hybrid": (10000.0, 16)}.get(arch, (10000.0, 4) if qwen else (None, 0))
        assert (a.rope_theta, a.rotary_dim) == rope
        assert (a.qk_norm, a.output_gate) == {"olmo_hybrid": ("all", False)}.get(
            arch, ("head", True) if qwen else ("none", False)
        )
    if arch == "nemotron_h":
        moe = cfg.moe
        assert moe is not None and cfg.mlp is not None and not cfg.mlp.gated and cfg.mlp.activation == "relu2"
        assert (moe.scoring, moe.correction_bias, moe.renormalize, moe.num_groups, moe.topk_groups) == (
            "sigmoid", True, True, 2, 1)  # fmt: skip
        assert (moe.num_experts, moe.top_k, moe.routed_scaling_factor, moe.shared_intermediate_size) == (8, 2, 1.5, 48)
    if arch == "granite_hybrid":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_multiplier) == (3.0, 0.5, 0.5)
        assert cfg.attention is not None and cfg.attention.softmax_scale == 0.2
        assert cfg.moe is not None and cfg.moe.expert_layout == "stacked" and cfg.moe.renormalize
    if arch == "falcon_h1":
        m2 = cfg.mamba2
        assert m2 is not None and m2.gate_norm == "rmsnorm_gate"
        assert m2.in_proj_multipliers == (0.9, 1.1, 1.2, 0.8, 1.05)
        assert (m2.input_multiplier, m2.output_multiplier) == (1.2, 0.85)
        assert cfg.attention is not None and cfg.attention.softmax_scale == pytest.approx(16**-0.5 * 0.9)
        assert cfg.mlp is not None and (cfg.mlp.gate_multiplier, cfg.mlp.down_multiplier) == (1.3, 0.8)
    if cfg.gdn is not None:  # 2 key heads x 16, 4 value heads x 8; conv over [q | k | v]
        g = cfg.gdn
        assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (2, 4, 16, 8, 4)
        assert g.conv_dim == 2 * 32 + 32 and cfg.ssm_chunk_size == 64
        assert g.projection == {"qwen3_next": "qwen3_next", "olmo_hybrid": "olmo_hybrid"}.get(arch, "qwen3_5")
        assert g.beta_scale == (2.0 if arch == "olmo_hybrid" else 1.0)
        assert [s.name for s in cfg.state_specs(0)] == ["conv", "recurrent"]
        assert cfg.state_bytes_per_slot(torch.bfloat16) == 2 * (96 * 3 * 2 + 4 * 16 * 8 * 4)
    if "moe" in arch or arch == "qwen3_next":  # softmax top-2 of 4, a gated shared expert
        m = cfg.moe
        assert m is not None and (m.num_experts, m.top_k, m.intermediate_size) == (4, 2, 32)
        assert (m.shared_intermediate_size, m.shared_gate, m.renormalize) == (48, True, arch != "qwen3_next")
    if arch == "zamba2":
        assert cfg.shared_blocks is not None and cfg.shared_blocks.num_blocks == 2 and cfg.shared_blocks.shared
        assert cfg.mlp is not None and cfg.mlp.fused_gate_up and cfg.mlp.activation == "gelu"
    if arch == "zamba":  # one shared block, no adapters, an unfused gated MLP
        sb = cfg.shared_blocks
        assert sb is not None and (sb.num_blocks, sb.adapter_rank, sb.shared) == (1, 0, True)
        assert cfg.mlp is not None and not cfg.mlp.fused_gate_up and cfg.mlp.activation == "gelu"
        assert [s.name for s in cfg.state_specs(1)] == ["conv", "ssm"] and cfg.attention_layers == (1, 3, 4)
    if arch == "minimax":  # lightning state: SSD's [H, P, N] with P = N = head_dim; Mixtral routing
        lt = cfg.lightning
        assert lt is not None and (lt.num_heads, lt.head_dim, lt.num_layers) == (4, 16, 4)
        assert [(s.name, s.shape) for s in cfg.state_specs(0)] == [("ssm", (4, 16, 16))]
        assert cfg.moe is not None and cfg.moe.renormalize and (cfg.moe.num_experts, cfg.moe.top_k) == (4, 2)
        assert cfg.minimax_factors == (1.0,) * 6
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
    for i, st in caches.state.items():  # conv windows in the model dtype, SSM and matrix states in fp32
        assert [t.dtype for t in st.tensors.values()] == [spec.resolve_dtype(dtype) for spec in cfg.state_specs(i)]
        assert all(t.dtype == torch.float32 for n, t in st.tensors.items() if n in ("ssm", "recurrent"))
    assert (cfg.kv_bytes_per_token(dtype) + cfg.window_bytes_per_token(dtype) > 0) == cfg.has_attention
    if arch == "mamba2":  # 2 layers x (conv 192 x 3 in dtype + ssm 8 x 16 x 16 in fp32)
        assert cfg.state_bytes_per_slot(dtype) == 2 * (192 * 3 * dtype.itemsize + 8 * 16 * 16 * 4)
    if arch == "bamba":  # 1 attention layer x K+V x 2 heads x 16
        assert cfg.kv_bytes_per_token(dtype) == 2 * 2 * 16 * dtype.itemsize


def test_nemotron_h_pattern_and_legacy_names() -> None:
    """hybrid_override_pattern (hub configs) and legacy mamba_* names translate like layers_block_type."""
    base = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 100, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "intermediate_size": 64}  # fmt: skip
    cfg = translate_config({**base, "hybrid_override_pattern": "M-*E", "mamba_n_groups": 2, "mamba_d_conv": 3,
                            "mamba_chunk_size": 64, "mamba_dt_min": 0.002})  # fmt: skip
    assert cfg.layer_types == ("mamba2", "none", "attention", "none")
    assert cfg.mlp_types == ("none", "dense", "none", "moe")
    m2 = cfg.mamba2
    assert m2 is not None and (m2.n_groups, m2.d_conv, m2.chunk_size) == (2, 3, 64)
    assert m2.time_step_limit == (0.002, math.inf)
    same = translate_config({**base, "layers_block_type": ["mamba", "mlp", "attention", "moe"]})
    assert (same.layer_types, same.mlp_types) == (cfg.layer_types, cfg.mlp_types)
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        translate_config({**base, "hybrid_override_pattern": "M-X"})
    with pytest.raises(ValueError, match="unknown layer kinds"):
        translate_config({**base, "layers_block_type": ["mamba", "gdn"]})


def test_granite_rejects_unknown_position_embedding() -> None:
    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100, "hidden_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 16, "mamba_n_heads": 4,
           "layer_types": ["mamba", "attention"], "position_embedding_type": "alibi"}  # fmt: skip
    with pytest.raises(UnsupportedArchitectureError, match="alibi"):
        translate_config(raw)


def test_per_layer_attention_settings(tiny_checkpoint) -> None:  # noqa: ANN001
    """`layer_attention` gives one attention layer its own settings (here NoPE and a bias), its KV shape included:
    the caches take each layer's own."""
    import dataclasses

    from recap.model.loader import build_model

    cfg = translate_config({**read_hf_config(tiny_checkpoint("bamba")), "attn_layer_indices": [1, 3]})
    assert cfg.attention is not None and cfg.attention.rope_theta is not None
    nope = dataclasses.replace(cfg.attention, rope_theta=None, rotary_dim=0, bias=True)
    per_layer = dataclasses.replace(cfg, layer_attention=(None, None, None, nope))
    model = build_model(per_layer)
    first, last = model.model.layers[1].self_attn, model.model.layers[3].self_attn
    assert first.rotary is not None and first.q_proj.bias is None
    assert last.rotary is None and last.q_proj.bias is not None
    assert per_layer.attention_for(3) is nope and per_layer.attention_for(1) is cfg.attention
    narrow = dataclasses.replace(cfg, layer_attention=(None, dataclasses.replace(nope, head_dim=8), None, None))
    caches = ModelCaches.allocate(narrow, 4, 16, 2, torch.float32)
    assert caches.kv[1].k_cache.shape[-1] == 8 and caches.kv[3].k_cache.shape[-1] == cfg.attention.head_dim
    assert narrow.kv_bytes_per_token(torch.float32) < cfg.kv_bytes_per_token(torch.float32)
    with pytest.raises(ValueError, match="without attention"):
        dataclasses.replace(cfg, layer_attention=(nope, None, None, None))
def test_hub_style_gdn_configs() -> None:
    """Hub config shapes: Qwen3-Next without layer_types (full_attention_interval, top-level rope keys) and a
    Qwen3.5 vision-language config (text_config with interleaved M-RoPE sections, which is plain RoPE for text)."""
    gdn = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # fmt: skip
    base = {"vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 512, "rms_norm_eps": 1e-6,
            **gdn}  # fmt: skip
    nxt = translate_config({**base, "architectures": ["Qwen3NextForCausalLM"], "full_attention_interval": 4,
                            "rope_theta": 1e7, "partial_rotary_factor": 0.25, "num_experts": 8,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                            "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
                            "norm_topk_prob": True, "mlp_only_layers": []})  # fmt: skip
    assert nxt.layer_types == ("gdn", "gdn", "gdn", "attention") * 2 and nxt.mlp_types == ("moe",) * 8
    assert nxt.attention is not None and (nxt.attention.rope_theta, nxt.attention.rotary_dim) == (1e7, 64)
    assert nxt.gdn is not None and nxt.gdn.projection == "qwen3_next"
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
            "mrope_section": [11, 11, 10]}  # fmt: skip
    text = {**base, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": 4,
            "rope_parameters": rope, "tie_word_embeddings": False}  # fmt: skip
    vl = translate_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                           "vision_config": {"depth": 2}, "tie_word_embeddings": True, "eos_token_id": 7})  # fmt: skip
    assert vl.architecture == "Qwen3_5ForConditionalGeneration" and vl.tie_word_embeddings and vl.eos_token_id == 7
    assert vl.gdn is not None and vl.gdn.projection == "qwen3_5" and vl.moe is None
    with pytest.raises(ValueError, match="text_config"):
        translate_config({"architectures": ["Qwen3_5ForConditionalGeneration"]})
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        translate_config({**text, "architectures": ["Qwen3_5ForCausalLM"], "rope_parameters": {"rope_type": "yarn"}})


@pytest.mark.parametrize(("arch", "kind_names"), [("zamba", {"linear_attention": "mamba1", "hybrid": "hybrid_mamba1"}),
                                                   ("minimax", {"linear_attention": "lightning",
                                                                "full_attention": "attention"})])  # fmt: skip
def test_default_layer_pattern_is_transformers(arch: str, kind_names: dict[str, str]) -> None:
    """A config without its layer list gets transformers' own default pattern (13 layers: two hybrid uses)."""
    from recap.model.testing import tiny_hf_config

    key = "layers_block_type" if arch == "zamba" else "layer_types"
    hf = tiny_hf_config(arch, num_hidden_layers=13, **{key: None}).to_dict()
    want = tuple(kind_names[k] for k in hf.pop(key))
    hf["architectures"] = [TINY_ARCHS[arch]]
    assert translate_config(hf).layer_types == want
