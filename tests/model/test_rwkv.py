"""RWKV-4: config translation (the tiny checkpoint's, the hub's config.json) and the variants hub checkpoints
ship, each equal to transformers' no-cache forward and greedy continuation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.config import load_config, translate_config
from recap.model.testing import forward_step, greedy_generate, tiny_hf_config

# RWKV/rwkv-4-169m-pile's config.json (the raven and 430m-14b checkpoints differ in sizes only; all set
# rescale_every 6 and untied heads)
HUB_169M = {
    "architectures": ["RwkvForCausalLM"], "model_type": "rwkv", "attention_hidden_size": 768, "bos_token_id": 0,
    "context_length": 1024, "eos_token_id": 0, "hidden_size": 768, "intermediate_size": 3072,
    "layer_norm_epsilon": 1e-05, "num_hidden_layers": 12, "rescale_every": 6, "tie_word_embeddings": False,
    "vocab_size": 50277,
}  # fmt: skip


def test_tiny_checkpoint_config(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("rwkv"))
    assert cfg.layer_types == ("rwkv",) * 4 and cfg.mlp_types == ("none",) * 4 and not cfg.has_attention
    r = cfg.rwkv
    assert r is not None and (r.hidden_size, r.attention_size, r.intermediate_size, r.rescale_every) == (64, 64, 128, 2)
    assert [(s.name, s.shape, s.dtype) for s in cfg.state_specs(0)] == [
        ("wkv", (3, 64), torch.float32), ("shift_att", (64, 1), None), ("shift_ffn", (64, 1), None)]  # fmt: skip
    assert cfg.state_bytes_per_slot(torch.bfloat16) == 4 * (3 * 64 * 4 + 2 * 64 * 2)
    assert [r.output_scale(i) for i in range(4)] == [1.0, 1.0, 0.5, 0.5]
    assert [r.halves_after(i) for i in range(4)] == [False, True, False, True]


def test_hub_config_169m() -> None:
    cfg = translate_config(HUB_169M)
    r = cfg.rwkv
    assert cfg.num_layers == 12 and r is not None and (r.attention_size, r.intermediate_size) == (768, 3072)
    assert (r.rescale_every, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (6, False, 1024)
    assert cfg.norm_eps == 1e-5 and cfg.eos_token_id == 0


def test_transformers_defaults_fill_missing_sizes() -> None:
    """No attention_hidden_size / intermediate_size / rescale_every: transformers' hidden, 4 x hidden and 6."""
    raw = {k: v for k, v in HUB_169M.items() if k not in ("attention_hidden_size", "intermediate_size",
                                                           "rescale_every")}  # fmt: skip
    r = translate_config(raw).rwkv
    assert r is not None and (r.attention_size, r.intermediate_size, r.rescale_every) == (768, 3072, 6)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        translate_config({**HUB_169M, "intermediate_size": 0})


def _checkpoint(path: Path, embed_scale: float, **overrides: object) -> Path:
    """A tiny RWKV built by transformers (+ its tiny jitter), the embeddings scaled (transformers initializes them
    at 1e-4 scale: a tied head would give logits of ~1e-3)."""
    import transformers as tf

    from recap.model.testing import _jitter_constants

    torch.manual_seed(5)
    model = tf.RwkvForCausalLM(tiny_hf_config("rwkv", **overrides)).eval()
    _jitter_constants(model, 5)
    with torch.no_grad():
        model.rwkv.embeddings.weight.mul_(embed_scale)
    model.save_pretrained(path)
    return path


# (overrides, embedding scale): what hub checkpoints set, and what RwkvConfig allows
VARIANTS = [
    ({"tie_word_embeddings": True}, 3e3),  # a tied head (transformers ties `head` to the embeddings)
    ({"rescale_every": 0}, 1.0),  # no rescaling
    ({"rescale_every": 1, "num_hidden_layers": 3}, 1.0),  # halved after every layer, outputs / 1, 2, 4
    ({"rescale_every": 6}, 1.0),  # the hub's value: no layer reaches it in 4
    ({"attention_hidden_size": 48, "layer_norm_epsilon": 1e-6}, 1.0),  # a WKV narrower than the model
]


@pytest.mark.parametrize(("overrides", "embed_scale"), VARIANTS)
def test_variants_match_transformers(overrides: dict, embed_scale: float, tmp_path: Path) -> None:
    import transformers as tf

    from recap.backends import prepare
    from recap.model.loader import load_model

    path = _checkpoint(tmp_path, embed_scale, **overrides)
    lm = load_model(path)
    backend = prepare(lm)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = tf.RwkvForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():  # no cache: transformers sizes its cached WKV state by hidden_size, not the WKV's width
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [], state_slot=1)], backend)
    logits = lm.model.compute_logits(hidden)
    scale = ref.abs().max()
    assert scale > 1.0
    assert (logits - ref).abs().max() <= 1e-4 * scale
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False,
        )  # fmt: skip
    assert greedy_generate(lm.model, ids, 6, backend=backend) == out[0, len(ids) :].tolist()
