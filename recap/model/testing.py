"""Tiny random HF checkpoints for tests anywhere (built with transformers' own classes, saved to disk)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from recap.kernels.kernel_set import KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec, build_forward_batch
from recap.model.cache import ModelCaches
from recap.model.models import CausalLM

# Short names -> HF architecture; the full architecture names are accepted too.
TINY_ARCHS = {
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granite_hybrid": "GraniteMoeHybridForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}
# Families whose tiny checkpoints get their constant-initialized weights (norms, D, dt_bias, biases) jittered,
# so that parity tests exercise them (transformers initializes them to 0 or 1).
PERTURBED = ("NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM")
# A Mamba2 shape shared by the tiny hybrids (HF_NOTES' layouts: in_proj 328, conv 192).
_M2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32}
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}

# Gated DeltaNet hybrids: 2 key heads x 16, 4 value heads x 8 (GQA of k vs v), attention at layers 1 and 3.
_GDN = {"num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "max_position_embeddings": 1024,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}  # fmt: skip
_QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48}  # fmt: skip
# A vision tower small enough to build in a test; recap skips its weights.
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A small transformers config (hidden 64, vocab 512, 2-4 layers, init range 0.1) for `arch`."""
    import transformers as tf

    arch = TINY_ARCHS.get(arch, arch)
    common: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "initializer_range": 0.1}
    if arch in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        cls = tf.MambaConfig if arch == "MambaForCausalLM" else tf.FalconMambaConfig
        kw = {"num_hidden_layers": 2, "state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": 4}
    elif arch == "Mamba2ForCausalLM":
        cls = tf.Mamba2Config
        kw = {"num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16,
              "expand": 2, "conv_kernel": 4, "chunk_size": 32, "tie_word_embeddings": False}  # fmt: skip
    elif arch == "BambaForCausalLM":
        cls = tf.BambaConfig
        kw = {"num_hidden_layers": 4, "attn_layer_indices": [1], "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16,
              "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32,
              "max_position_embeddings": 1024}  # fmt: skip
    elif arch == "JambaForCausalLM":
        cls = tf.JambaConfig
        kw = {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_state": 16, "mamba_dt_rank": 4}  # fmt: skip
    elif arch == "NemotronHForCausalLM":
        cls = tf.NemotronHConfig
        kw = {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"], "intermediate_size": 128,
              "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 32,
              "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
              "max_position_embeddings": 1024, **_ATTN}  # fmt: skip
    elif arch == "GraniteMoeHybridForCausalLM":
        cls = tf.GraniteMoeHybridConfig
        kw = {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"], "intermediate_size": 32,
              "shared_intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
              "position_embedding_type": "nope", "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
              "attention_multiplier": 0.2, "logits_scaling": 2.0, "max_position_embeddings": 1024,
              **_M2, **_ATTN}  # fmt: skip
    elif arch == "FalconH1ForCausalLM":
        cls = tf.FalconH1Config
        kw = {"num_hidden_layers": 3, "intermediate_size": 128, "mamba_d_ssm": 128, "mamba_rms_norm": True,
              "embedding_multiplier": 1.5, "lm_head_multiplier": 0.7, "mlp_multipliers": [1.3, 0.8],
              "key_multiplier": 0.9,
              "attention_in_multiplier": 1.1, "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.2,
              "ssm_out_multiplier": 0.85, "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.05],
              "max_position_embeddings": 1024, **_M2, **_ATTN}  # fmt: skip
    elif arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "OlmoHybridForCausalLM"):
        cls = {"Qwen3_5ForCausalLM": tf.Qwen3_5TextConfig, "Qwen3_5MoeForCausalLM": tf.Qwen3_5MoeTextConfig,
               "Qwen3NextForCausalLM": tf.Qwen3NextConfig, "OlmoHybridForCausalLM": tf.OlmoHybridConfig}[arch]
        kw = dict(_GDN, **(_QWEN_MOE if arch in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM") else {}))
        if arch == "Qwen3NextForCausalLM":  # layer 2 dense: mlp_only_layers
            kw.update(mlp_only_layers=[2], norm_topk_prob=False)
        if arch == "OlmoHybridForCausalLM":
            kw.pop("head_dim")  # OLMo derives it from hidden_size / num_attention_heads
            kw.update(linear_a_log_min=0.0, linear_a_log_max=2.0, pad_token_id=None, eos_token_id=2)
    elif arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        moe = arch.startswith("Qwen3_5Moe")
        cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        text = {**common, **_GDN, **(_QWEN_MOE if moe else {}), **overrides.pop("text_config", {})}
        return cls(text_config=text, vision_config=_VISION, **overrides)
    elif arch == "Zamba2ForCausalLM":
        cls = tf.Zamba2Config
        kw = {"num_hidden_layers": 5, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
              "mamba_d_state": 16, "n_mamba_heads": 8, "mamba_ngroups": 2, "chunk_size": 32, "intermediate_size": 96,
              "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
              "max_position_embeddings": 1024, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
    elif arch in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM"):
        cls = {"Lfm2ForCausalLM": tf.Lfm2Config, "Lfm2MoeForCausalLM": tf.Lfm2MoeConfig,
               "Lfm3ForCausalLM": tf.Lfm3Config}[arch]  # fmt: skip
        kinds = ["conv", "full_attention", "conv", "sliding_attention" if arch == "Lfm3ForCausalLM" else "conv"]
        kw = {"num_hidden_layers": 4, "layer_types": kinds, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "conv_L_cache": 3, "max_position_embeddings": 1024, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
        if arch == "Lfm2MoeForCausalLM":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1)
        if arch == "Lfm3ForCausalLM":
            kw.update(head_dim=16, sliding_window=12, conv_L_cache=5)
    elif arch == "KimiLinearForCausalLM":
        cls = tf.KimiLinearConfig
        kw = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_num_heads": 4,
              "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2}  # fmt: skip
    else:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {sorted(TINY_ARCHS)}")
    return cls(**{**common, **kw, **overrides})


def make_tiny_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a random-weight `arch` model with transformers and `save_pretrained` it into `path`.

    `arch` is a short name ("mamba", "falcon_mamba", "mamba2", "bamba", "jamba") or an HF
    architecture name; `overrides` go to the transformers config. Returns `path`.
    """
    import transformers as tf

    config = tiny_hf_config(arch, **overrides)
    name = TINY_ARCHS.get(arch, arch)
    cls = getattr(tf, name)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if name in PERTURBED:
        _jitter_constants(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def _jitter_constants(model: torch.nn.Module, seed: int) -> None:
    """Add N(0, 0.1) noise to every 1-D tensor of the checkpoint (norm weights, D, dt_bias, biases, ...)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.dim() == 1 and t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.1)


class StepBackend(Protocol):
    """What a test step needs of a runner's backend (recap/backends/base.py's Backend)."""

    kernels: KernelSet

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor: ...


def forward_step(
    model: CausalLM, caches: ModelCaches, seqs: Sequence[SeqSpec], backend: StepBackend | None = None
) -> tuple[torch.Tensor, ForwardBatch]:
    """Pack `seqs` into a ForwardBatch for `model` and run it (through `backend` as a runner does; None: the
    model's forward with the reference kernels): (final hidden [T, D], batch)."""
    cfg = model.config
    batch = build_forward_batch(
        seqs,
        block_size=caches.block_size,
        chunk_size=cfg.ssm_chunk_size,
        with_attention=bool(cfg.full_attention_layers),
        with_ssm=cfg.has_ssm,
        with_window=bool(cfg.window_layers),
        kernels=None if backend is None else backend.kernels,
    )
    return (model(batch, caches) if backend is None else backend.forward(model, batch, caches)), batch


def greedy_generate(
    model: CausalLM, prompt: Sequence[int], max_new_tokens: int, block_size: int = 16, slot: int = 1,
    backend: StepBackend | None = None,
) -> list[int]:  # fmt: skip
    """Greedy tokens for one sequence: one prefill step, then one decode step per token (update kernels); through
    `backend` as a runner does, or the model's forward."""
    total = len(prompt) + max_new_tokens
    blocks = list(range(1, 2 + total // block_size))  # block 0 is the null block
    caches = ModelCaches.allocate(
        model.config, len(blocks) + 1, block_size, slot + 1, model.dtype, num_window_blocks=len(blocks) + 1
    )
    tokens, out, context = list(prompt), [], 0
    while len(out) < max_new_tokens:
        new = tokens[context:]
        spec = SeqSpec(new, context_len=context, block_ids=blocks, state_slot=slot)
        hidden, batch = forward_step(model, caches, [spec], backend)
        logits = model.compute_logits(hidden[batch.logits_indices])
        context += len(new)
        out.append(int(logits[0].argmax()))
        tokens.append(out[-1])
    return out
