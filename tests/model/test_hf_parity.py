"""recap equals transformers on the same checkpoint: full-sequence logits and greedy continuation."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.testing import TINY_ARCHS, forward_step, greedy_generate

ARCHS = tuple(TINY_ARCHS)
# transformers' cached generate sizes xLSTM's cache by the config's widths rounded to 64, not the layers' own
# int(hidden * factor): a tiny checkpoint's cache does not fit, so its generate runs without the cache
NO_HF_CACHE = frozenset({"xlstm"})

PROMPT_LEN = 40
NEW_TOKENS = 12


def _hf_model(path):  # noqa: ANN001, ANN202
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    except ValueError:  # a vision-language class with no causal-LM mapping (GLM-5.3-Flash): its own class
        arch = transformers.AutoConfig.from_pretrained(path).architectures[0]
        return getattr(transformers, arch).from_pretrained(path).eval()


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_sequence_logits_match_transformers(arch, tiny_checkpoint, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    cfg = lm.config
    ids = _prompt(cfg.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        ref = _hf_model(tiny_checkpoint(arch))(torch.tensor([ids]), use_cache=False).logits[0].float()
    caches = ModelCaches.allocate(cfg, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)], backend)
    logits = lm.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    scale = ref.abs().max()
    assert scale > 1.0  # non-trivial logits
    assert (logits - ref).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_transformers_generate(arch, tiny_checkpoint, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    ids = _prompt(lm.config.vocab_size, PROMPT_LEN, seed=1)
    hf = _hf_model(tiny_checkpoint(arch))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            use_cache=arch not in NO_HF_CACHE,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    assert greedy_generate(lm.model, ids, NEW_TOKENS, backend=backend) == expected


# Config variants a hub checkpoint of each family may have (each its own tiny checkpoint).
VARIANTS: list[tuple[str, dict]] = [
    ("bamba", {"hidden_act": "gelu"}),  # conv and MLP activation by name
    ("nemotron_h", {"layers_block_type": ["attention", "mamba", "mlp", "mamba"], "tie_word_embeddings": True}),
    ("nemotron_h", {"layers_block_type": ["mamba", "moe", "mamba", "attention", "moe"], "n_group": 1,
                    "topk_group": 1, "norm_topk_prob": False, "moe_latent_size": 24, "mlp_bias": True}),
    ("nemotron_h", {"layers_block_type": ["moe", "attention", "mamba"], "n_routed_experts": 6, "n_group": 3,
                    "topk_group": 2, "num_experts_per_tok": 3, "mlp_hidden_act": "gelu"}),
    # Nemotron-3 Nano Omni whose language model carries MTP layers (transformers then builds a vision norm that
    # recap skips), attention first
    ("nemotron_h_omni", {"text_config": {"num_nextn_predict_layers": 1,
                                         "layers_block_type": ["attention", "mamba", "moe", "mamba"]}}),
    # MiniCPM-V 4.6 with its head tied; MiniCPM-OCR untied though its text config ties (the outer flag governs),
    # attention first
    ("minicpmv4_6", {"tie_word_embeddings": True}),
    ("minicpm_ocr", {"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True, "layer_types": [
        "full_attention", "linear_attention", "linear_attention", "full_attention"]}}),
    ("granite_hybrid", {"position_embedding_type": "rope", "attention_bias": True, "tie_word_embeddings": True}),
    ("granite_hybrid", {"num_local_experts": 0, "layer_types": ["attention", "mamba", "attention", "mamba"]}),
    ("granite_hybrid", {"layer_types": ["mamba", "mamba", "attention"], "num_hidden_layers": 3,
                        "time_step_limit": [0.01, 0.5], "mamba_proj_bias": True, "mamba_conv_bias": False}),
    ("falcon_h1", {"mamba_norm_before_gate": False}),
    ("falcon_h1", {"mamba_rms_norm": False, "projectors_bias": True, "attention_bias": True, "mlp_bias": True,
                   "mamba_proj_bias": True}),
    ("falcon_h1", {"mamba_d_ssm": 96, "mamba_n_heads": 6, "tie_word_embeddings": True, "head_dim": 24,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    ("zamba2", {"use_shared_attention_adapter": False, "use_mem_rope": False, "tie_word_embeddings": False,
                "num_mem_blocks": 1, "num_key_value_heads": 2, "hidden_act": "silu"}),
    ("zamba2", {"add_bias_linear": True, "layers_block_type": ["hybrid", "mamba", "mamba", "hybrid"],
                "num_hidden_layers": 4}),
    # GLM-5.3-Flash: tied head, softplus KDA gate (no lower bound), a SwiGLU clamp that bites, 2 streams
    ("glm5_next", {"tie_word_embeddings": True,
                   "text_config": {"linear_lower_bound": None, "swiglu_limit": 0.05, "hc_mult": 2}}),
    # single-token pools (no tail), no MoE, a shared selection right after the first layer
    ("glm5_next", {"text_config": {"index_kpool": 1, "index_topk": 5, "index_kpool_always_select_tail": False,
                                   "layer_types": ["indexed_attention", "indexed_attention", "linear_attention",
                                                   "indexed_attention", "linear_attention"],
                                   "indexer_types": ["full", "shared", "full", "full", "full"],
                                   "mlp_layer_types": ["dense"] * 5}}),
    ("zamba", {"tie_word_embeddings": False, "num_key_value_heads": 2, "hidden_act": "silu", "n_mamba_heads": 4,
               "mamba_proj_bias": True, "layers_block_type": ["hybrid", "mamba", "mamba", "hybrid"],
               "num_hidden_layers": 4}),
    # (transformers cannot build a tied Zamba with a single hybrid layer: its tie pattern finds no target)
    ("zamba", {"n_mamba_heads": 1, "mamba_conv_bias": False, "layers_block_type": ["mamba", "hybrid", "hybrid"],
               "num_hidden_layers": 3, "mamba_d_conv": 3}),
    # residual factors, tied embeddings, transformers' whole-head RoPE (it reads no partial factor), HF blocks of 8
    ("minimax", {"tie_word_embeddings": True, "full_attn_alpha_factor": 1.3, "full_attn_beta_factor": 0.7,
                 "linear_attn_alpha_factor": 0.9, "linear_attn_beta_factor": 1.2, "mlp_alpha_factor": 1.1,
                 "mlp_beta_factor": 0.8, "block_size": 8,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
    # one expert (MoE off in effect: a dense gated MLP), attention first, 2 heads of 24, GQA 2:1, gelu
    ("minimax", {"num_local_experts": 1, "num_experts_per_tok": 1, "num_hidden_layers": 3, "head_dim": 24,
                 "layer_types": ["full_attention", "linear_attention", "linear_attention"],
                 "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "gelu"}),
    # RecurrentGemma: the hub's MQA (1 KV head), a soft cap that bites, an RG-LRU wider than the model (gate blocks
    # of 24), an untied head, hidden 80 (sqrt(80) rounds in bfloat16), conv width 3, biased q/k/v, attention every
    # other layer
    ("recurrent_gemma", {"hidden_size": 80, "num_key_value_heads": 1, "logits_soft_cap": 2.0, "lru_width": 96,
                         "tie_word_embeddings": False, "conv1d_width": 3, "attention_bias": True,
                         "block_types": ["recurrent", "attention"], "num_hidden_layers": 3}),
    # attention first, a window wider than the prompt, whole-head RoPE (theta 1e4), exact gelu
    ("recurrent_gemma", {"block_types": ["attention", "recurrent", "recurrent"], "attention_window_size": 64,
                         "hidden_activation": "gelu",
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}),
    # Ling 3.0: tie_word_embeddings set (transformers still keeps lm_head apart), softplus KDA gate (no safe
    # bound), transformers' default layer pattern (MLA closing a group of 3), unnormalized top-k in one group,
    # 2 shared experts, RoPE at the hub's theta
    ("bailing_hybrid", {"tie_word_embeddings": True, "kda_safe_gate": False, "layer_group_size": 3,
                        "num_hidden_layers": 6, "first_k_dense_replace": 2, "norm_topk_prob": False, "n_group": 1,
                        "n_shared_experts": 2, "routed_scaling_factor": 1.0, "rope_theta": 6e6}),
    # no MoE (all dense), MLA first, a tighter safe gate, untied head
    ("bailing_hybrid", {"layer_types": ["full_attention", "linear_attention", "linear_attention"],
                        "num_hidden_layers": 3, "first_k_dense_replace": 3, "kda_lower_bound": -2.0}),
    # Qwen4-Exp: tied head, 3 streams, QSA first with blocks of 2 (6 tokens' budget), 4:1 GQA, full RoPE,
    # unnormalized top-k, transformers' default pattern (full_attention_interval) over 5 layers
    ("qwen4_exp", {"tie_word_embeddings": True, "hc_count": 3, "hc_lowrank": 8, "indexer_compress_ratio": 2,
                   "indexer_budget": 6, "num_key_value_heads": 1, "norm_topk_prob": False,
                   "layer_types": ["indexed_attention", "linear_attention", "linear_attention", "full_attention"],
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}),
    ("qwen4_exp", {"layer_types": None, "num_hidden_layers": 5, "full_attention_interval": 2,
                   "indexer_budget": 12, "indexer_compress_ratio": 6, "indexer_head_dim": 24}),
    # Inkling: the hub's layout (no layer_types: every sixth layer full; every layer a sink MoE), no log scaling,
    # a bias extent past the prompt, 1 shared expert, top-3
    ("inkling", {"layer_types": None, "mlp_layer_types": None, "num_hidden_layers": 6, "log_scaling_n_floor": None,
                 "rel_extent": 64, "n_shared_experts": 1, "num_experts_per_tok": 3}),
    # no MoE, a head padded past the vocabulary, window 5, conv kernel 3, MHA sliding layers, gelu
    ("inkling", {"mlp_layer_types": ["dense"] * 4, "unpadded_vocab_size": 500, "sliding_window_size": 5,
                 "conv_kernel_size": 3, "swa_num_key_value_heads": 4, "hidden_act": "gelu"}),
    # Inkling-2: the hub's layout (no layer_types: every sixth layer full; one residual block of 6), its clips,
    # softcaps and log-scaling floor (far past the prompt), a head padded past the vocabulary
    ("inkling2", {"layer_types": None, "num_hidden_layers": 6, "n_layers_per_attn_res_block": 6,
                  "log_scaling_n_floor": 128000, "unpadded_vocab_size": 500, "qk_l2_clip_threshold": 22.6,
                  "rel_l2_clip_threshold": 8.0, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
                  "final_logit_softcapping": 30.0}),
    # conv kernel 3, window 5, MHA sliding layers, top-1 routing, blocks of 3
    ("inkling2", {"conv_kernel_size": 3, "sliding_window_size": 5, "swa_num_key_value_heads": 4,
                  "num_experts_per_tok": 1, "n_layers_per_attn_res_block": 3}),
    # Zaya as the hub ships it (ZAYA1-8B: full attention everywhere, convs 2 and 2, tied, the hub's nested rope
    # dict with a stray rope_type); untied with biased projections and its own RoPE per layer kind
    ("zaya", {"layer_types": None, "cca_time1": 2, "rope_parameters": {"rope_type": "default",
        "hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5}}}),
    ("zaya", {"tie_word_embeddings": False, "attention_bias": True, "sliding_window": 3, "cca_time0": 3,
              "rope_parameters": {"hybrid": {"rope_type": "default", "rope_theta": 1000.0,
                                             "partial_rotary_factor": 1.0},
                                  "hybrid_sliding": {"rope_type": "default", "rope_theta": 100.0,
                                                     "partial_rotary_factor": 0.25}}}),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "overrides"), VARIANTS)
def test_config_variants_match_transformers(arch, overrides, tmp_path) -> None:  # noqa: ANN001
    from recap.backends import prepare
    from recap.model.loader import load_model
    from recap.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, tmp_path, seed=3, **overrides)
    lm = load_model(path)
    backend = prepare(lm)
    ids = _prompt(lm.config.vocab_size, PROMPT_LEN, seed=2)
    hf = _hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)], backend)
    logits = lm.model.compute_logits(hidden)
    scale = ref.abs().max()
    assert scale > 1.0
    assert (logits - ref).abs().max() <= 1e-4 * scale
    # Without HF's cache: its one-token Mamba2 path skips the time_step_limit clamp that its full forward applies.
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False,
        )  # fmt: skip
    assert greedy_generate(lm.model, ids, 6, backend=backend) == out[0, len(ids) :].tolist()
