"""The embedded default model builds offline, loads strictly, tokenizes chat and runs."""

from __future__ import annotations

import torch

from recap.engine.model_defaults import generation_defaults
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.default_model import DEFAULT_MAX_NEW_TOKENS, SPECIAL_TOKENS, ensure_random_model
from recap.model.loader import load_model, load_tokenizer
from recap.model.testing import forward_step


def test_default_model_builds_and_runs(tmp_path) -> None:  # noqa: ANN001
    folder = ensure_random_model(tmp_path / "default")
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(tmp_path / "default") == folder  # built once
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["default"]  # no temp folder left behind
    # a request that names no max_tokens stops here (its generation config, as vLLM reads it)
    assert generation_defaults(folder) == {"max_tokens": DEFAULT_MAX_NEW_TOKENS}

    lm = load_model(folder)
    cfg = lm.config
    assert cfg.architecture == "BambaForCausalLM" and cfg.hidden_size == 512
    assert cfg.attention_layers == (4, 10) and len(cfg.ssm_layers) == 12

    tok = load_tokenizer(folder)
    assert len(tok) <= cfg.vocab_size
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text

    caches = ModelCaches.allocate(cfg, 4, 16, 2, torch.float32)
    hidden, batch = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)])
    logits = lm.model.compute_logits(hidden[batch.logits_indices])
    assert logits.shape == (1, cfg.vocab_size) and torch.isfinite(logits).all()
