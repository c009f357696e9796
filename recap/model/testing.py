"""Tiny random HF checkpoints for tests anywhere (built with transformers' own classes, saved to disk)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

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
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}


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
    cls = getattr(tf, TINY_ARCHS.get(arch, arch))
    torch.manual_seed(seed)
    model = cls(config).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def forward_step(model: CausalLM, caches: ModelCaches, seqs: Sequence[SeqSpec]) -> tuple[torch.Tensor, ForwardBatch]:
    """Pack `seqs` into a ForwardBatch for `model` and run it: (final hidden [T, D], batch)."""
    cfg = model.config
    batch = build_forward_batch(
        seqs,
        block_size=caches.block_size,
        chunk_size=cfg.ssm_chunk_size,
        with_attention=bool(cfg.full_attention_layers),
        with_ssm=cfg.has_ssm,
        with_window=bool(cfg.window_layers),
    )
    return model(batch, caches), batch


def greedy_generate(
    model: CausalLM, prompt: Sequence[int], max_new_tokens: int, block_size: int = 16, slot: int = 1
) -> list[int]:
    """Greedy tokens for one sequence: one prefill step, then one decode step per token (update kernels)."""
    total = len(prompt) + max_new_tokens
    blocks = list(range(1, 2 + total // block_size))  # block 0 is the null block
    caches = ModelCaches.allocate(
        model.config, len(blocks) + 1, block_size, slot + 1, model.dtype, num_window_blocks=len(blocks) + 1
    )
    tokens, out, context = list(prompt), [], 0
    while len(out) < max_new_tokens:
        new = tokens[context:]
        spec = SeqSpec(new, context_len=context, block_ids=blocks, state_slot=slot)
        hidden, batch = forward_step(model, caches, [spec])
        logits = model.compute_logits(hidden[batch.logits_indices])
        context += len(new)
        out.append(int(logits[0].argmax()))
        tokens.append(out[-1])
    return out
