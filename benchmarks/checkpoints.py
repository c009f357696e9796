"""The random-weight checkpoints the speed benchmarks share (seeded, built once with transformers' classes).

- mamba2-130m: Mamba2 (d_model 768, 24 layers, 24 heads x 64, state 128, vocab 50280, tied), 129M params
- hybrid-130m: Bamba-style (d_model 768, 10 layers: attention at 3 and 7, MLP 2048, vocab 32000), ~130M
- mamba2-115m: as mamba2-130m with a 32000-token vocabulary (115M), the peers benchmark's Mamba2
- hybrid-163m: Granite-4-style Bamba (d_model 768, 24 layers: 20 Mamba2 + attention at 5, 11, 17, 23,
  MLP 1024, vocab 32000, tied), 163M: the peers benchmark's hybrid
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = ("mamba2-130m", "hybrid-130m", "mamba2-115m", "hybrid-163m")
DEFAULT_CACHE = Path.home() / ".cache" / "recap" / "bench-models"


def _config(name: str) -> tuple[Any, Any]:
    import transformers as tf

    if name.startswith("mamba2-"):
        cfg = tf.Mamba2Config(
            vocab_size=50280 if name == "mamba2-130m" else 32000, hidden_size=768, num_hidden_layers=24,
            num_heads=24, head_dim=64, expand=2, state_size=128, n_groups=1, chunk_size=256,
            tie_word_embeddings=True, initializer_range=0.02,
        )  # fmt: skip
        return cfg, tf.Mamba2ForCausalLM
    if name == "hybrid-130m":
        cfg = tf.BambaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
            attn_layer_indices=[3, 7], num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=24,
            mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, initializer_range=0.02,
        )  # fmt: skip
        return cfg, tf.BambaForCausalLM
    if name == "hybrid-163m":
        cfg = tf.BambaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=1024, num_hidden_layers=24,
            attn_layer_indices=[5, 11, 17, 23], num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=24,
            mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, initializer_range=0.02,
            tie_word_embeddings=True,
        )  # fmt: skip
        return cfg, tf.BambaForCausalLM
    raise ValueError(f"unknown benchmark checkpoint {name!r}; choose one of {CHECKPOINTS}")


def build_checkpoint(name: str, folder: Path) -> Path:
    """The checkpoint `name` in `folder` (built with seed 0 on first use)."""
    if (folder / "model.safetensors").is_file():
        return folder
    cfg, cls = _config(name)
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(str(folder))
    return folder
