"""Random-weight checkpoints at real ~1.2B shapes (bench_memory.py's models), written once in bf16.

- granite-h-1b: GraniteMoeHybrid dense, shaped like ibm-granite/granite-4.0-h-1b's config.json: d_model 1536,
  40 layers (attention, NoPE, at 5, 15, 25 and 35; 36 Mamba2 layers of 48 heads x 64, 1 group, state 128,
  conv 4), a shared SwiGLU MLP of 4096 in every layer, 12 heads (4 KV), vocab 100352, tied: 1.46B params
- lfm2-1.2b: LFM2 shaped like LiquidAI/LFM2-1.2B's config.json: d_model 2048, 16 layers (attention at 2, 5, 8,
  10, 12 and 14, 32 heads, 8 KV; 10 short convs, L 3), SwiGLU MLP of intermediate_size 12288 auto-adjusted to
  8192, vocab 65536, tied: 1.17B params

Built with transformers' own classes (their `save_pretrained` writes the on-disk key layout recap reads), the
weights initialised in bf16 (half the bytes to hold and write; each is cast to the serving dtype at load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPES = ("granite-h-1b", "lfm2-1.2b")
DEFAULT_CACHE = Path.home() / ".cache" / "recap" / "bench-models"


def _granite_h_1b() -> tuple[Any, Any]:
    import transformers as tf

    attention = {5, 15, 25, 35}
    cfg = tf.GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=40,
        layer_types=["attention" if i in attention else "mamba" for i in range(40)], num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=4096, shared_intermediate_size=4096, num_local_experts=0,
        num_experts_per_tok=0, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
        max_position_embeddings=131072, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    return tf.GraniteMoeHybridForCausalLM, cfg


def _lfm2_1_2b() -> tuple[Any, Any]:
    import transformers as tf

    attention = {2, 5, 8, 10, 12, 14}
    cfg = tf.Lfm2Config(
        vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, layer_types=["full_attention" if i in attention else "conv" for i in range(16)],
        conv_L_cache=3, block_auto_adjust_ff_dim=True, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        max_position_embeddings=128000, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    return tf.Lfm2ForCausalLM, cfg


_BUILDERS = {"granite-h-1b": _granite_h_1b, "lfm2-1.2b": _lfm2_1_2b}


def build_checkpoint(name: str, cache: Path = DEFAULT_CACHE) -> Path:
    """The checkpoint `name` under `cache` (built with seed 0 on first use; a finished build leaves config.json
    last, so a build that was stopped half-way is rebuilt)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown shape {name!r}; choose one of {SHAPES}")
    folder = cache / name
    if (folder / "config.json").is_file():
        save_tokenizer(folder)
        return folder
    cls, cfg = _BUILDERS[name]()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    tmp = cache / f"{name}.partial"
    model.save_pretrained(str(tmp))
    config = tmp / "config.json"
    config.rename(tmp / "config.json.tmp")  # the folder counts as built only once it is in place
    tmp.rename(folder)
    (folder / "config.json.tmp").rename(folder / "config.json")
    save_tokenizer(folder)
    return folder


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer ("t0" .. "t{V-1}") over the checkpoint's vocabulary, beside its weights."""
    if (folder / "tokenizer.json").is_file():
        return
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(folder))


def num_params(folder: Path) -> int:
    """Parameters stored in the checkpoint (from the safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    for shape in sys.argv[1:] or SHAPES:
        out = build_checkpoint(shape)
        print(f"{shape}: {out} ({num_params(out) / 1e9:.2f}B params)")
