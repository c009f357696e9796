"""recap equals transformers on the same checkpoint: full-sequence logits and greedy continuation."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.testing import TINY_ARCHS, forward_step, greedy_generate

ARCHS = tuple(TINY_ARCHS)

PROMPT_LEN = 40
NEW_TOKENS = 12


def _hf_model(path):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_sequence_logits_match_transformers(arch, tiny_checkpoint, tiny_model) -> None:  # noqa: ANN001
    lm = tiny_model(arch)
    cfg = lm.config
    ids = _prompt(cfg.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        ref = _hf_model(tiny_checkpoint(arch))(torch.tensor([ids])).logits[0].float()
    caches = ModelCaches.allocate(cfg, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)])
    logits = lm.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    scale = ref.abs().max()
    assert scale > 1.0  # non-trivial logits
    assert (logits - ref).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_transformers_generate(arch, tiny_checkpoint, tiny_model) -> None:  # noqa: ANN001
    lm = tiny_model(arch)
    ids = _prompt(lm.config.vocab_size, PROMPT_LEN, seed=1)
    hf = _hf_model(tiny_checkpoint(arch))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    assert greedy_generate(lm.model, ids, NEW_TOKENS) == expected
