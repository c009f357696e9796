"""The model families recap runs, one entry per HF architecture name: its translator, its model class, the
`model_type`s that name it and its tiny test checkpoint's config.

`TRANSLATORS`, `MODEL_TYPES`, `MODEL_CLASSES` (models/__init__.py) and `TINY_ARCHS` (testing.py) are views of
`FAMILIES`. Model classes are imported only when asked for (`Family.model_class`), so reading a config imports
no layer. A family on existing layer kinds = a translator (translators/), one model file (models/) and one
entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recap.model.model_config import ModelConfig
from recap.model.translators.bailing import _bailing_hybrid
from recap.model.translators.common import UnsupportedArchitectureError
from recap.model.translators.gated_deltanet import _minicpm_v, _olmo_hybrid, _qwen3_5_vl, _qwen_gdn
from recap.model.translators.glm5_next import _glm5_next
from recap.model.translators.inkling import _inkling, _inkling2, _inkling2_vl, _inkling_vl
from recap.model.translators.lfm_kimi import _kimi_linear, _lfm, _lfm_vl
from recap.model.translators.mamba import _bamba, _jamba, _mamba, _mamba2
from recap.model.translators.mamba2_hybrids import (
    _falcon_h1,
    _granite_moe_hybrid,
    _nemotron_h,
    _nemotron_h_omni,
    _zamba,
    _zamba2,
)
from recap.model.translators.minimax import _minimax
from recap.model.translators.qwen4_exp import _qwen4_exp, _qwen4_exp_vl
from recap.model.translators.recurrent_gemma import _recurrent_gemma
from recap.model.translators.rwkv import _rwkv
from recap.model.translators.xlstm import _xlstm
from recap.model.translators.zaya import _zaya

if TYPE_CHECKING:
    from recap.model.models.base import CausalLM

Translator = Callable[[Mapping[str, Any], str], ModelConfig]


@dataclass(frozen=True)
class TinyConfig:
    """The family's tiny random checkpoint for tests (recap.model.testing): transformers' config class
    `hf_config` with hidden 64, vocab 512, init range 0.1 and `kwargs` (the text config's, with a tiny vision
    tower, where `vision`: TINY_VISION, or the configs `towers` names); `jitter`: its constant-initialized
    weights (norms, D, dt_bias, biases) get noise, so that parity tests exercise them (transformers
    initializes them to 0 or 1)."""

    name: str  # the short name tests use
    hf_config: str
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    jitter: bool = False
    vision: bool = False
    towers: Mapping[str, Any] | None = field(default=None, hash=False)  # `vision`'s towers, if not TINY_VISION
    # jitter every constant-initialized tensor, whatever its shape (Inkling-2's zero conv taps and residual
    # queries, its clip scales of ones)
    jitter_all: bool = False


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json `architectures[0]`, and the name of the model class
    translator: Translator  # (HF config dict, architecture) -> ModelConfig
    module: str  # the module under recap.model.models defining the class `architecture`
    model_types: tuple[str, ...]  # config.json `model_type`s naming this architecture (configs without one)
    tiny: TinyConfig
    aliases: tuple[str, ...] = ()  # other config.json architecture names for the same layout (the hub's)

    def model_class(self) -> type[CausalLM]:
        return getattr(importlib.import_module(f"recap.model.models.{self.module}"), self.architecture)


# Tiny shapes shared by several families. Mamba2 as the hybrids use it (HF_NOTES' layouts: in_proj 328, conv 192).
_M2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32}
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}
_MAMBA1 = {"num_hidden_layers": 2, "state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": 4}
# Gated DeltaNet hybrids: 2 key heads x 16, 4 value heads x 8 (GQA of k vs v), attention at layers 1 and 3.
_GDN = {"num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "max_position_embeddings": 1024,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}  # fmt: skip
_QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48}  # fmt: skip
_LFM = {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"], "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3, "max_position_embeddings": 1024,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip

_TINY_MAMBA2 = {"num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "expand": 2,
                "conv_kernel": 4, "chunk_size": 32, "tie_word_embeddings": False}  # fmt: skip
_TINY_BAMBA = {"num_hidden_layers": 4, "attn_layer_indices": [1], "intermediate_size": 128,
               "max_position_embeddings": 1024, **_M2, **_ATTN}  # fmt: skip
_TINY_JAMBA = {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
               "mamba_d_state": 16, "mamba_dt_rank": 4, **_ATTN}  # fmt: skip
_TINY_NEMOTRON_H = {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"],
                    "intermediate_size": 128, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
                    "ssm_state_size": 16, "chunk_size": 32, "head_dim": 16, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5, "max_position_embeddings": 1024,
                    **_ATTN}  # fmt: skip
_TINY_GRANITE = {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                 "intermediate_size": 32, "shared_intermediate_size": 64, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "position_embedding_type": "nope", "embedding_multiplier": 3.0,
                 "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0,
                 "max_position_embeddings": 1024, **_M2, **_ATTN}  # fmt: skip
_TINY_FALCON_H1 = {"num_hidden_layers": 3, "intermediate_size": 128, "mamba_d_ssm": 128, "mamba_rms_norm": True,
                   "embedding_multiplier": 1.5, "lm_head_multiplier": 0.7, "mlp_multipliers": [1.3, 0.8],
                   "key_multiplier": 0.9, "attention_in_multiplier": 1.1, "attention_out_multiplier": 0.9,
                   "ssm_in_multiplier": 1.2, "ssm_out_multiplier": 0.85, "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.05],
                   "max_position_embeddings": 1024, **_M2, **_ATTN}  # fmt: skip
_TINY_OLMO = {**{k: v for k, v in _GDN.items() if k != "head_dim"},  # OLMo derives it: hidden / heads
              "linear_a_log_min": 0.0, "linear_a_log_max": 2.0, "pad_token_id": None, "eos_token_id": 2}  # fmt: skip
_TINY_ZAMBA2 = {"num_hidden_layers": 5, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
                "mamba_d_state": 16, "n_mamba_heads": 8, "mamba_ngroups": 2, "chunk_size": 32, "intermediate_size": 96,
                "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
                "max_position_embeddings": 1024, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
_TINY_ZAMBA = {"num_hidden_layers": 5, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
               "n_mamba_heads": 2, "mamba_d_state": 16, "mamba_dt_rank": 4, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
_TINY_MINIMAX = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                 "linear_attention"], "head_dim": 16, "intermediate_size": 32,
                 "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16, "max_position_embeddings": 1024,
                 **_ATTN}  # fmt: skip
_TINY_LFM3 = {**_LFM, "layer_types": ["conv", "full_attention", "conv", "sliding_attention"], "head_dim": 16,
              "sliding_window": 12, "conv_L_cache": 5}  # fmt: skip
_TINY_KIMI = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_num_heads": 4,
              "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2}  # fmt: skip
# GLM-5.3-Flash: KDA, indexed MLA (a full indexer at 1, 2 and 4, 3 sharing 2's selection; top-k 8 tokens in pools
# of 4, so a prompt past 12 tokens attends sparsely), 3 residual streams, dense and MoE feed-forwards.
_TINY_GLM5 = {"num_hidden_layers": 5, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                              "indexed_attention"],
              "indexer_types": ["full", "full", "shared", "full", "full"],
              "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse"], "q_lora_rank": 32,
              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_rope_head_dim": 0,
              "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8, "index_kpool": 4, "linear_num_heads": 4,
              "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "hc_mult": 3, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 1024}  # fmt: skip
# RecurrentGemma: recurrent, recurrent, attention, recurrent; window 12 (< the parity prompts, < a block)
_TINY_RG = {"num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "attention_window_size": 12}  # fmt: skip

# Ling 3.0: KDA at 0 and 2, MLA (RoPE on 8 dims, head gate) at 1 and 3; layer 0 dense, then MoE in 2 groups.
_TINY_BAILING = {"num_hidden_layers": 4, "layer_group_size": 2, "first_k_dense_replace": 1, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "kv_lora_rank": 16,
                 "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
                 "topk_group": 1, "num_mtp_layers": 0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                 "max_position_embeddings": 1024, "rope_theta": 10000.0}  # fmt: skip
# Qwen4-Exp: GDN at 0 and 2 (Qwen3.5's shapes), QSA attention at 1 and 3 (blocks of 4 tokens, 8 tokens' budget,
# so a prompt past 12 tokens attends sparsely; 8 indexer heads, so that no two blocks tie at a zero score, which
# transformers leaves to its sort; no pad id: a pad row of zeros zeroes a token's streams, and so its indexer
# query, making every score 0), 2 streams of hyper-connections, MoE everywhere; per-layer n-gram embeddings
# (trigrams, 2 heads each, tables of ~100 rows in 3 shards) on GDN layer 2.
_TINY_QWEN4 = {**_GDN, **_QWEN_MOE, "layer_types": ["linear_attention", "indexed_attention"] * 2, "hc_count": 2,
               "hc_lowrank": 16, "indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 16,
               "indexer_budget": 8, "indexer_compress_ratio": 4, "pad_token_id": None, "bos_token_id": 1,
               "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5},
               "ple_layer_ids": [3], "ple_embed_dim": 32, "heads_per_ngram": 2, "ngram_vocab_size_base": 100,
               "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 3, "ple_conv_kernel_size": 3}  # fmt: skip
# RWKV-4: 4 layers, rescaling after every 2nd (so that it bites), channel mix 128 wide; transformers' own init
# otherwise (jitter: time_decay/time_first and the norms)
# Zaya: 4 heads / 2 KV heads of 16, convs 2 and 3, sliding (window 6) at 1 and 3, 4 experts + the skip one.
_TINY_ZAYA = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "layer_types": ["hybrid", "hybrid_sliding"] * 2, "sliding_window": 6, "cca_time0": 2, "cca_time1": 3,
              "num_experts": 4, "moe_intermediate_size": 32, "router_hidden_size": 32,
              "max_position_embeddings": 1024}  # fmt: skip
_TINY_RWKV = {"num_hidden_layers": 4, "intermediate_size": 128, "rescale_every": 2, "context_length": 1024}
# Inkling: sliding attention (window 12, 1 KV head of 8 dims) at 0 and 2, full attention (2 KV heads of 16, bias
# over 20 distances, log-scaled from position 8) at 1 and 3; layer 0 dense, then sink MoEs with 2 shared experts.
_TINY_INKLING = {"num_hidden_layers": 4, "layer_types": ["hybrid_sliding", "hybrid"] * 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1,
                 "swa_head_dim": 8, "sliding_window_size": 12, "d_rel": 4, "rel_extent": 20,
                 "log_scaling_n_floor": 8, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                 "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "n_shared_experts": 2, "logits_mup_width_multiplier": 2.0,
                 "max_position_embeddings": 1024}  # fmt: skip
# Inkling-2: full attention (dynamic K/V convs, bias over 20 distances, log-scaled from position 8) at 0 and 3,
# sliding (window 12) at 1 and 2; blocks of 2 layers for the block attention residuals; softcaps that bite.
_TINY_INKLING2 = {"num_hidden_layers": 4, "layer_types": ["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"],
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4,
                  "swa_num_key_value_heads": 1, "swa_head_dim": 8, "sliding_window_size": 12, "d_rel": 4,
                  "rel_extent": 20, "log_scaling_n_floor": 8, "moe_intermediate_size": 32, "n_routed_experts": 4,
                  "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2, "qk_l2_clip_threshold": 2.0,
                  "rel_l2_clip_threshold": 1.0, "mlp_gate_softcap": 0.5, "mlp_up_softcap": 1.0,
                  "final_logit_softcapping": 10.0, "eos_token_id": 2, "max_position_embeddings": 1024}  # fmt: skip
# The hub's Inkling checkpoints: vision and audio towers (skipped), the text model in Thinking Machines' layout.
_INKLING_TOWERS = {"vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
                   "audio_config": {"n_mel_bins": 4, "mel_vocab_size": 8}}  # fmt: skip
# Inkling-2's vision tower, as small as its config allows (skipped by recap); text_hidden_size: the tiny text width
_INKLING2_TOWERS = {"vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "projection_hidden_dim": 32, "posemb_grid_size": 4,
                                      "text_hidden_size": 64}}  # fmt: skip
# LFM2-VL / LFM3-VL's vision towers, as small as their configs allow (skipped by recap); LFM2-VL's tiny text model
# ranks token 2 (LFM2's eos) first mid-continuation, which generate's min_new_tokens forbids: eos moved to 511
_LFM_VL_TOWERS = {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "num_key_value_heads": 2}, "projector_hidden_size": 32}
# Nemotron-3 Nano Omni's towers, as small as their configs allow (skipped by recap): RADIO (patches of 4, its video
# patch size as the wrapper's), its projector, and the Parakeet audio encoder with its projector's sizes.
_OMNI_TOWERS = {"vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "patch_size": 4, "image_size": 16, "max_img_size": 32,
                                  "video_temporal_patch_size": 2},
                "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "intermediate_size": 64, "subsampling_conv_channels": 8, "num_mel_bins": 16,
                                 "projection_hidden_size": 32, "projection_bias": False},
                "projector_hidden_size": 32, "vision_hidden_size": 32}  # fmt: skip
# MiniCPM-V 4.6 / 4.7 / MiniCPM-OCR's SigLIP2 vision tower, as small as its config allows (skipped by recap)
_MINICPM_TOWERS = {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2}}  # fmt: skip
# xLSTM: 3 layers of 4 heads (qk head 8, v head 16), chunk 16 in transformers (so its parity prompts cross its
# chunkwise and sequential paths); gate biases jittered off transformers' -10 / 3..6 init, its zero gate weights too
_TINY_XLSTM = {"num_hidden_layers": 3, "num_heads": 4, "chunk_size": 16, "pad_token_id": 1, "bos_token_id": 0,
               "eos_token_id": 2}

FAMILIES: tuple[Family, ...] = (
    Family("MambaForCausalLM", _mamba, "mamba", ("mamba",), TinyConfig("mamba", "MambaConfig", _MAMBA1)),
    Family("FalconMambaForCausalLM", _mamba, "mamba", ("falcon_mamba",),
           TinyConfig("falcon_mamba", "FalconMambaConfig", _MAMBA1)),
    Family("Mamba2ForCausalLM", _mamba2, "mamba", ("mamba2",), TinyConfig("mamba2", "Mamba2Config", _TINY_MAMBA2)),
    Family("BambaForCausalLM", _bamba, "bamba", ("bamba",), TinyConfig("bamba", "BambaConfig", _TINY_BAMBA)),
    Family("JambaForCausalLM", _jamba, "jamba", ("jamba",), TinyConfig("jamba", "JambaConfig", _TINY_JAMBA)),
    Family("NemotronHForCausalLM", _nemotron_h, "nemotron_h", ("nemotron_h",),
           TinyConfig("nemotron_h", "NemotronHConfig", _TINY_NEMOTRON_H, jitter=True)),
    Family("NemotronH_Omni_Reasoning_V3", _nemotron_h_omni, "nemotron_h",
           ("nemotron_h_omni", "NemotronH_Nano_Omni_Reasoning_V3"),
           TinyConfig("nemotron_h_omni", "NemotronH_Omni_Reasoning_V3_Config", _TINY_NEMOTRON_H, jitter=True,
                      vision=True, towers=_OMNI_TOWERS),
           aliases=("NemotronH_Nano_Omni_Reasoning_V3",)),  # the released (remote-code) configs' name and type
    Family("GraniteMoeHybridForCausalLM", _granite_moe_hybrid, "granite_moe_hybrid", ("granitemoehybrid",),
           TinyConfig("granite_hybrid", "GraniteMoeHybridConfig", _TINY_GRANITE, jitter=True)),
    Family("FalconH1ForCausalLM", _falcon_h1, "falcon_h1", ("falcon_h1",),
           TinyConfig("falcon_h1", "FalconH1Config", _TINY_FALCON_H1, jitter=True)),
    Family("Qwen3_5ForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_5_text",),
           TinyConfig("qwen3_5", "Qwen3_5TextConfig", _GDN)),
    Family("Qwen3_5MoeForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_5_moe_text",),
           TinyConfig("qwen3_5_moe", "Qwen3_5MoeTextConfig", {**_GDN, **_QWEN_MOE})),
    Family("Qwen3NextForCausalLM", _qwen_gdn, "qwen3_5", ("qwen3_next",),  # layer 2 dense: mlp_only_layers
           TinyConfig("qwen3_next", "Qwen3NextConfig",
                      {**_GDN, **_QWEN_MOE, "mlp_only_layers": [2], "norm_topk_prob": False})),
    Family("Qwen3_5ForConditionalGeneration", _qwen3_5_vl, "qwen3_5", ("qwen3_5",),
           TinyConfig("qwen3_5_vl", "Qwen3_5Config", _GDN, vision=True)),
    Family("Qwen3_5MoeForConditionalGeneration", _qwen3_5_vl, "qwen3_5", ("qwen3_5_moe",),
           TinyConfig("qwen3_5_moe_vl", "Qwen3_5MoeConfig", {**_GDN, **_QWEN_MOE}, vision=True)),
    # one layout (Qwen3.5 under model.language_model, SigLIP2 tower, merger): one class, registered per name
    Family("MiniCPMV4_6ForConditionalGeneration", _minicpm_v, "qwen3_5", ("minicpmv4_6",),
           TinyConfig("minicpmv4_6", "MiniCPMV4_6Config", _GDN, vision=True, towers=_MINICPM_TOWERS)),
    Family("MiniCPMV4_7ForConditionalGeneration", _minicpm_v, "qwen3_5", ("minicpmv4_7",),
           TinyConfig("minicpmv4_7", "MiniCPMV4_7Config", _GDN, vision=True, towers=_MINICPM_TOWERS)),
    Family("MiniCPMOcrForConditionalGeneration", _minicpm_v, "qwen3_5", ("minicpm_ocr",),  # head tied by default
           TinyConfig("minicpm_ocr", "MiniCPMOcrConfig", _GDN, vision=True, towers=_MINICPM_TOWERS)),
    Family("OlmoHybridForCausalLM", _olmo_hybrid, "olmo_hybrid", ("olmo_hybrid",),
           TinyConfig("olmo_hybrid", "OlmoHybridConfig", _TINY_OLMO)),
    Family("Zamba2ForCausalLM", _zamba2, "zamba2", ("zamba2",),
           TinyConfig("zamba2", "Zamba2Config", _TINY_ZAMBA2, jitter=True)),
    Family("ZambaForCausalLM", _zamba, "zamba", ("zamba",),
           TinyConfig("zamba", "ZambaConfig", _TINY_ZAMBA, jitter=True)),
    Family("MiniMaxForCausalLM", _minimax, "minimax", ("minimax",),
           TinyConfig("minimax", "MiniMaxConfig", _TINY_MINIMAX, jitter=True)),
    Family("Lfm2ForCausalLM", _lfm, "lfm2", ("lfm2",), TinyConfig("lfm2", "Lfm2Config", _LFM)),
    Family("Lfm2MoeForCausalLM", _lfm, "lfm2_moe", ("lfm2_moe",),
           TinyConfig("lfm2_moe", "Lfm2MoeConfig", {**_LFM, "num_experts": 4, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": 32, "num_dense_layers": 1})),
    Family("Lfm3ForCausalLM", _lfm, "lfm3", ("lfm3",), TinyConfig("lfm3", "Lfm3Config", _TINY_LFM3)),
    Family("Lfm2VlForConditionalGeneration", _lfm_vl, "lfm2", ("lfm2_vl",),
           TinyConfig("lfm2_vl", "Lfm2VlConfig", {**_LFM, "eos_token_id": 511}, vision=True, towers=_LFM_VL_TOWERS)),
    Family("Lfm3VlForConditionalGeneration", _lfm_vl, "lfm3", ("lfm3_vl",),
           TinyConfig("lfm3_vl", "Lfm3VlConfig", _TINY_LFM3, vision=True, towers=_LFM_VL_TOWERS)),
    Family("KimiLinearForCausalLM", _kimi_linear, "kimi_linear", ("kimi_linear",),
           TinyConfig("kimi_linear", "KimiLinearConfig", _TINY_KIMI)),
    Family("Glm5NextForConditionalGeneration", _glm5_next, "glm5_next", ("glm5_next",),
           TinyConfig("glm5_next", "Glm5NextConfig", _TINY_GLM5, jitter=True, vision=True)),
    Family("RecurrentGemmaForCausalLM", _recurrent_gemma, "recurrent_gemma", ("recurrent_gemma",),
           TinyConfig("recurrent_gemma", "RecurrentGemmaConfig", _TINY_RG, jitter=True)),
    Family("BailingHybridForCausalLM", _bailing_hybrid, "bailing_hybrid", ("bailing_hybrid",),
           TinyConfig("bailing_hybrid", "BailingHybridConfig", _TINY_BAILING, jitter=True),
           aliases=("BailingMoeV3ForCausalLM", "BailingMoeV2_5ForCausalLM")),
    Family("Qwen4ExpForCausalLM", _qwen4_exp, "qwen4_exp", ("qwen4_exp_text",),
           TinyConfig("qwen4_exp", "Qwen4ExpTextConfig", _TINY_QWEN4, jitter=True)),
    Family("Qwen4ExpForConditionalGeneration", _qwen4_exp_vl, "qwen4_exp", ("qwen4_exp",),
           TinyConfig("qwen4_exp_vl", "Qwen4ExpConfig", _TINY_QWEN4, jitter=True, vision=True)),
    Family("RwkvForCausalLM", _rwkv, "rwkv", ("rwkv",), TinyConfig("rwkv", "RwkvConfig", _TINY_RWKV, jitter=True)),
    Family("InklingForCausalLM", _inkling, "inkling", ("inkling_text",),
           TinyConfig("inkling", "InklingTextConfig", _TINY_INKLING, jitter=True)),
    Family("Inkling2ForCausalLM", _inkling2, "inkling2", ("inkling2_text",),
           TinyConfig("inkling2", "Inkling2TextConfig", _TINY_INKLING2, jitter=True, jitter_all=True)),
    Family("Inkling2ForConditionalGeneration", _inkling2_vl, "inkling2", ("inkling2",),
           TinyConfig("inkling2_vl", "Inkling2Config", _TINY_INKLING2, jitter=True, jitter_all=True, vision=True,
                      towers=_INKLING2_TOWERS)),
    Family("InklingForConditionalGeneration", _inkling_vl, "inkling", ("inkling_mm_model",),
           TinyConfig("inkling_vl", "InklingConfig", _TINY_INKLING, jitter=True, vision=True, towers=_INKLING_TOWERS)),
    Family("xLSTMForCausalLM", _xlstm, "xlstm", ("xlstm",),
           TinyConfig("xlstm", "xLSTMConfig", _TINY_XLSTM, jitter=True, jitter_all=True)),
    Family("ZayaForCausalLM", _zaya, "zaya", ("zaya",), TinyConfig("zaya", "ZayaConfig", _TINY_ZAYA, jitter=True,
                                                                    jitter_all=True)),
)  # fmt: skip
BY_ARCHITECTURE: dict[str, Family] = {name: f for f in FAMILIES for name in (f.architecture, *f.aliases)}

# The views the rest of recap reads.
TRANSLATORS: dict[str, Translator] = {f.architecture: f.translator for f in FAMILIES}
MODEL_TYPES: dict[str, str] = {t: f.architecture for f in FAMILIES for t in f.model_types}  # configs naming none
TINY_ARCHS: dict[str, str] = {f.tiny.name: f.architecture for f in FAMILIES}  # short test name -> architecture


def family(architecture: str) -> Family:
    """The family of `architecture`; UnsupportedArchitectureError (listing the supported ones) if recap has none."""
    found = BY_ARCHITECTURE.get(architecture)
    if found is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture}; supported: {', '.join(sorted(BY_ARCHITECTURE))}"
        )
    return found
