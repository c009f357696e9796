"""Qwen4-Exp's per-layer n-gram embeddings (PLE) equal transformers', with the dilated conv's weights nonzero
(transformers initializes them to 0), on prompts that cross EOS tokens (the n-gram context restarts after one):
full-sequence logits, and the same sequence stepped in pieces through the state slot (the ids window and the
conv window carry over); the hub's table shards and buffers load; the translator refuses what it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.config import UnsupportedArchitectureError
from recap.model.hf_config import translate_config
from recap.model.layers.ple import primes_from, shard_rows
from recap.model.loader import load_model
from recap.model.testing import forward_step, tiny_hf_config

PLE = {"ple_layer_ids": [1, 3], "ple_embed_dim": 32, "heads_per_ngram": 2, "ngram_vocab_size_base": 100,
       "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 3, "ngram_size": 3,
       "ple_conv_kernel_size": 3}  # fmt: skip


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(tiny_hf_config("qwen4_exp", **PLE)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.ple is not None:
                layer.ple.conv1d.weight.normal_(0.0, 0.3)
                layer.ple.norm_conv.weight.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("qwen4_ple")
    model.save_pretrained(path)
    return path


def _prompt() -> list[int]:
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ids[9], ids[10], ids[23] = 2, 2, 2  # EOS twice in a row, and once more
    return ids


def test_ple_logits_match_transformers(ple_checkpoint: Path) -> None:
    import transformers

    ids = _prompt()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ple_checkpoint).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    lm = load_model(ple_checkpoint)
    assert lm.config.layer_types == ("gdn_ple", "attention", "gdn_ple", "attention")
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)])
    logits = lm.model.compute_logits(hidden)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
    # the same sequence in pieces: each continues from the slot's PLE windows and the cached K/V
    caches, done, pieces = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32), 0, []
    for n in (1, 10, 2, 27):
        hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids[done : done + n], done, [1, 2, 3], state_slot=1)])
        pieces.append(lm.model.compute_logits(hidden))
        done += n
    torch.testing.assert_close(torch.cat(pieces), logits, rtol=1e-4, atol=1e-4)


def test_table_layout() -> None:
    assert primes_from(100, 3) == (101, 103, 107)
    assert shard_rows(424, 4) == [106] * 4 and shard_rows(10, 4) == [3, 3, 3, 1] and shard_rows(5, 4) == [2, 2, 1]


def test_refused_variants() -> None:
    base = tiny_hf_config("qwen4_exp").to_dict()
    for bad, match in (({"output_gate_type": "sigmoid"}, "output gate"), ({"indexer_n_heads": None}, "indexer"),
                       ({"ple_layer_ids": [2]}, "linear_attention")):  # fmt: skip
        with pytest.raises(UnsupportedArchitectureError, match=match):
            translate_config({**base, **bad, "architectures": ["Qwen4ExpForCausalLM"]})
