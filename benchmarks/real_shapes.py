"""Random-weight checkpoints at real ~1.2B shapes (bench_memory.py's models), written once in bf16.

- granite-h-1b: GraniteMoeHybrid dense, shaped like ibm-granite/granite-4.0-h-1b's config.json: d_model 1536,
  40 layers (attention, NoPE, at 5, 15, 25 and 35; 36 Mamba2 layers of 48 heads x 64, 1 group, state 128,
  conv 4), a shared SwiGLU MLP of 4096 in every layer, 12 heads (4 KV), vocab 100352, tied: 1.46B params
- lfm2-1.2b: LFM2 shaped like LiquidAI/LFM2-1.2B's config.json: d_model 2048, 16 layers (attention at 2, 5, 8,
  10, 12 and 14, 32 heads, 8 KV; 10 short convs, L 3), SwiGLU MLP of intermediate_size 12288 auto-adjusted to
  8192, vocab 65536, tied: 1.17B params
- granite-h-7b: the granite-h-1b design at a 7B size (d_model 4096, 32 layers, attention at 4, 12, 20 and 28,
  Mamba2 of 128 heads x 64, shared MLP 8192, 32 heads (8 KV), vocab 100352, tied): 6.66B params, for the issue's
  "a 7B hybrid loads and decodes in int4 within 8 GiB"
- nemotron-h-8b: NemotronH dense, shaped like nvidia/Nemotron-H-8B-Base-8K's config.json: d_model 4096, 52 layers
  of hybrid_override_pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba2 of 128 heads x 64,
  8 groups, state 128, conv 4; 24 relu2 MLPs of 21504; 4 attention layers, 32 heads (8 KV) of 128, no RoPE),
  vocab 131072, untied head: 8.10B params (16.2 GB of bf16 on disk)
- qwen3_5-0.8b: the text model of Qwen/Qwen3.5-0.8B (Qwen3_5ForCausalLM on Qwen3_5TextConfig; the hub checkpoint is
  the vision-language Qwen3_5ForConditionalGeneration, whose vision tower and MTP head are left out): 0.75B params.
  From the published model card's figures (its config.json was not reachable): d_model 1024, 24 layers as
  6 x (3 GDN + 1 gated attention), attention 8 heads / 2 KV of head_dim 256 (gated q_proj, q/k norms, as the
  config class builds it), rope_theta 1e7, SwiGLU MLP 3584, vocab 248320, 262144 positions. Approximations:
  GDN of 16 key heads and 16 value heads of 128 (a third-party description of the 0.8B's GDN layer says 16 x 128),
  conv 4, partial rotary 0.25 (the config class's defaults) and tied embeddings

Each model is described by transformers' own config and model classes, built on the meta device (no memory),
and its tensors are written one shard at a time under the names `save_pretrained` uses for these classes (the
state dict's: GraniteMoeHybrid and LFM2 have no legacy renames; NemotronH's `model.` is `backbone.` on disk), in
bf16 (half the bytes to write; each is cast to the serving dtype at load): a 7B checkpoint is written without
holding the model. The values are random normal(0, 0.02) for matrices and the usual constants for norms, decays
and biases: shapes are what matters here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SHAPES = ("granite-h-1b", "lfm2-1.2b", "granite-h-7b", "nemotron-h-8b", "qwen3_5-0.8b")
SHARD_BYTES = 2 << 30
DEFAULT_CACHE = Path.home() / ".cache" / "recap" / "bench-models"


def _granite_h(layers: int, attention: set[int], d_model: int, heads: int, kv_heads: int, mlp: int,
               mamba_heads: int) -> tuple[Any, Any]:
    import transformers as tf

    cfg = tf.GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=d_model, num_hidden_layers=layers,
        layer_types=["attention" if i in attention else "mamba" for i in range(layers)], num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=mlp, shared_intermediate_size=mlp, num_local_experts=0,
        num_experts_per_tok=0, mamba_n_heads=mamba_heads, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
        max_position_embeddings=131072, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    return tf.GraniteMoeHybridForCausalLM, cfg


def _granite_h_1b() -> tuple[Any, Any]:
    return _granite_h(40, {5, 15, 25, 35}, 1536, 12, 4, 4096, 48)


def _granite_h_7b() -> tuple[Any, Any]:
    return _granite_h(32, {4, 12, 20, 28}, 4096, 32, 8, 8192, 128)


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _nemotron_h_8b() -> tuple[Any, Any]:
    import transformers as tf

    cfg = tf.NemotronHConfig(
        vocab_size=131072, hidden_size=4096, num_hidden_layers=52, hybrid_override_pattern=NEMOTRON_H_8B_PATTERN,
        intermediate_size=21504, mlp_hidden_act="relu2", num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
        expand=2, chunk_size=128, use_conv_bias=True, use_bias=False, mamba_proj_bias=False, attention_bias=False,
        mlp_bias=False, layer_norm_epsilon=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
        initializer_range=0.02,
    )  # fmt: skip
    return tf.NemotronHForCausalLM, cfg


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


def _qwen3_5_0_8b() -> tuple[Any, Any]:
    import transformers as tf

    layers = 24
    cfg = tf.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=layers, intermediate_size=3584,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    return tf.Qwen3_5ForCausalLM, cfg


_BUILDERS = {"granite-h-1b": _granite_h_1b, "lfm2-1.2b": _lfm2_1_2b, "granite-h-7b": _granite_h_7b,
             "nemotron-h-8b": _nemotron_h_8b, "qwen3_5-0.8b": _qwen3_5_0_8b}
# What save_pretrained writes in place of the in-memory prefix (transformers' legacy checkpoint layout).
_DISK_PREFIX = {"NemotronHForCausalLM": ("model.", "backbone.")}


def build_checkpoint(name: str, cache: Path = DEFAULT_CACHE) -> Path:
    """The checkpoint `name` under `cache` (built with seed 0 on first use; a finished build leaves config.json
    last, so a build that was stopped half-way is rebuilt)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown shape {name!r}; choose one of {SHAPES}")
    folder = cache / name
    if (folder / "config.json").is_file():
        _add_architectures(folder / "config.json", _BUILDERS[name]()[0].__name__)
        save_tokenizer(folder)
        return folder
    cls, cfg = _BUILDERS[name]()
    tmp = cache / f"{name}.partial"
    write_random_weights(cls, cfg, tmp)
    cfg.architectures = [cls.__name__]  # a config saved without its model has none; llama.cpp's converter needs it
    cfg.save_pretrained(str(tmp))
    config = tmp / "config.json"
    config.rename(tmp / "config.json.tmp")  # the folder counts as built only once it is in place
    tmp.rename(folder)
    (folder / "config.json.tmp").rename(folder / "config.json")
    save_tokenizer(folder)
    return folder


def _add_architectures(config: Path, arch: str) -> None:
    """Repair a checkpoint written before build_checkpoint set `architectures` (llama.cpp's converter reads
    the class from it; recap and transformers fall back to model_type)."""
    cfg = json.loads(config.read_text())
    if not cfg.get("architectures"):
        tmp = config.with_suffix(".arch.tmp")
        tmp.write_text(json.dumps({"architectures": [arch], **cfg}, indent=2))
        tmp.rename(config)


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 2)[-2:]
    if "norm" in name or leaf[-1] == "D":
        return torch.ones(shape, dtype=torch.bfloat16)
    if leaf[-1] == "A_log":
        return torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32)).to(torch.bfloat16)
    if leaf[-1] in ("bias", "dt_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def write_random_weights(cls: Any, cfg: Any, folder: Path) -> None:
    """The model's tensors (names and shapes from the model built on the meta device), random, in bf16
    safetensors shards of about SHARD_BYTES with their index: one shard in memory at a time."""
    import json

    from safetensors.torch import save_file

    memory, disk = _DISK_PREFIX.get(cls.__name__, ("", ""))
    with torch.device("meta"):
        shapes = {(disk + k.removeprefix(memory) if memory and k.startswith(memory) else k): tuple(v.shape)
                  for k, v in cls(cfg).state_dict().items()}  # fmt: skip
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    size = 0
    names: list[list[str]] = [[]]
    for key, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if size and size + n > SHARD_BYTES:
            names.append([])
            size = 0
        names[-1].append(key)
        size += n
    total = len(names)
    weight_map = {}
    for i, keys in enumerate(names):
        file = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file({k: _random_tensor(k, shapes[k], gen) for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": sum(2 * int(torch.Size(s).numel()) for s in shapes.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


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
