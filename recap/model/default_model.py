"""The random-weight hybrid (`ensure_random_model`) + a byte-level BPE tokenizer, for tests and benchmark shapes.

The served default is the trained model (recap/model/trained_default.py); this one remains for the tests that
need a model without shipped weights, the `default` benchmark shape and the tiny test checkpoints' tokenizer.

Built once (seeded, so every machine builds the same files) into a cache folder with an atomic
rename, so `recap bench` runs on a fresh machine without network. Shape: 14 layers
(Mamba2 everywhere except attention at layers 4 and 10), d_model 512, vocab 4096. Its
generation_config.json caps a request that names no `max_tokens` at DEFAULT_MAX_NEW_TOKENS (random
weights seldom say EOS, and the context is 8,192 tokens): read as vLLM reads it
(recap/engine/model_defaults.py), so a bare chat request returns in seconds.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_NAME = "default-hybrid-v2"  # v2: generation_config.json gained max_new_tokens
SEED = 1234
VOCAB_SIZE = 4096
DEFAULT_MAX_NEW_TOKENS = 256
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "recap" / DEFAULT_NAME


def _corpus(seed: int, num_lines: int = 6000) -> list[str]:
    """Seeded pseudo-text from syllables, so BPE finds a few thousand merges without any data files."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    words = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 1, 2, 2, 3)))) for _ in range(3000)]
    weights = [1.0 / (r + 1) for r in range(len(words))]  # Zipf-like frequencies
    lines = []
    for _ in range(num_lines):
        sent = " ".join(rng.choices(words, weights, k=rng.randint(4, 16)))
        lines.append(sent.capitalize() + rng.choice([".", ".", "?", "!", ",", ":"]) + rng.choice(["", " 42", "\n"]))
    return lines


def save_tokenizer(folder: Path, seed: int = SEED, vocab_size: int = VOCAB_SIZE) -> int:
    """Train the default byte-level BPE (seeded corpus, at most `vocab_size` ids, >= 260) into `folder`.

    Returns the tokenizer's vocab size. A smaller `vocab_size` suits tiny test models (e.g. 512).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(str(folder))
    return tok.get_vocab_size()


def _save_model(folder: Path, seed: int) -> None:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=14,
        attn_layer_indices=[4, 10],
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_n_heads=16,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        max_position_embeddings=8192,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=[0, 3],  # <|endoftext|>, <|im_end|>
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = BambaForCausalLM(config).eval()
    model.generation_config.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    model.save_pretrained(str(folder))


def ensure_random_model(cache_dir: Path | None = None) -> Path:
    """The folder of the random-weight model, building it first if absent. Safe against concurrent builders."""
    final = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if all((final / f).is_file() for f in REQUIRED_FILES):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        vocab = save_tokenizer(tmp, SEED)
        if vocab > VOCAB_SIZE:
            raise RuntimeError(f"tokenizer vocab {vocab} exceeds the model vocab {VOCAB_SIZE}")
        _save_model(tmp, SEED)
        try:
            os.rename(tmp, final)  # atomic: readers see no folder or a complete one
        except OSError:
            if not all((final / f).is_file() for f in REQUIRED_FILES):
                raise
            # Another process finished first; its folder is identical (same seed).
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


