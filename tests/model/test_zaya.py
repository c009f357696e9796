"""Zaya: its config translation (refusals, the state a layer declares), the composed CCA conv against the two
convs transformers stacks, and routing that spreads over the experts and the skip expert, equal to transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.config import translate_config
from recap.model.testing import forward_step, greedy_generate, tiny_hf_config

BASE = {"architectures": ["ZayaForCausalLM"], "model_type": "zaya", "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def test_translation_and_state_specs() -> None:
    cfg = translate_config({**BASE, "cca_time0": 2, "cca_time1": 3, "layer_types": ["hybrid", "hybrid_sliding"],
                            "sliding_window": 8})  # fmt: skip
    assert cfg.layer_types == ("cca_attention",) * 2 and cfg.attention_windows == (0, 8)
    assert cfg.attention_for(0).rope_theta == 5_000_000.0 and cfg.attention_for(1).rope_theta == 10_000.0
    assert cfg.attention_for(0).rotary_dim == 8  # partial rotary 0.5 of 16
    specs = {s.name: s.shape for s in cfg.state_specs(1)}
    assert specs == {"conv_qk": (96, 3), "shift_v": (64, 1)}  # (4 + 2) heads x 16, kernels 2 + 3 - 1 - 1


@pytest.mark.parametrize("bad", [{"num_experts_per_tok": 2}, {"lm_head_bias": True}, {"hidden_act": "gelu"},
                                 {"layer_types": ["hybrid", "full_attention"]},
                                 {"layer_types": ["hybrid", "hybrid_sliding"]}])  # fmt: skip
def test_refused_configs(bad: dict) -> None:
    with pytest.raises(ValueError):
        translate_config({**BASE, **bad})


def test_composed_conv_equals_the_two_convs() -> None:
    from torch import nn

    from recap.model.layers.cca import cca_conv

    g = torch.Generator().manual_seed(0)
    c, hd, k0, k1, t = 24, 4, 3, 2, 9
    dw, gr = nn.Conv1d(c, c, k0, groups=c), nn.Conv1d(c, c, k1, groups=c // hd)
    for p in (*dw.parameters(), *gr.parameters()):
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(t, c, generator=g)
    with torch.no_grad():
        want = gr(dw(nn.functional.pad(x.t()[None], (k0 + k1 - 2, 0))))[0].t()
    padded = torch.cat([torch.zeros(k0 + k1 - 2, c), x])
    windows = padded.unfold(0, k0 + k1 - 1, 1).flip(-1)  # [T, C, K], the token first
    assert torch.allclose(cca_conv(windows, dw, gr, hd), want, atol=1e-5)


def test_spread_routing_and_skip_expert_match_transformers(tmp_path: Path) -> None:
    """Balancing biases that send tokens to every expert and to the skip expert (the tiny checkpoint's router
    picks one expert per layer)."""
    import transformers as tf

    from recap.backends import prepare
    from recap.model.loader import load_model

    torch.manual_seed(7)
    hf = tf.ZayaForCausalLM(tiny_hf_config("zaya")).eval()
    picks = []
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.balancing_biases.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0]))
            layer.mlp.gate.router_mlp.out_proj.weight.mul_(40.0)  # confident, varied choices
            layer.self_attn.qk_norm.temp.fill_(2.0)
            layer.mlp.gate.register_forward_hook(lambda m, i, o: picks.append((o[2], o[1])))
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    chosen = torch.cat([p[0] for p in picks]).flatten()
    skipped = torch.cat([p[1] for p in picks]).flatten() == 0  # transformers zeroes the skip expert's weight
    assert len(set(chosen.tolist())) >= 3 and 0 < int(skipped.sum()) < skipped.numel()
    lm = load_model(tmp_path)
    backend = prepare(lm)
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [1, 2, 3], state_slot=1)], backend)
    logits = lm.model.compute_logits(hidden)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
    assert greedy_generate(lm.model, ids, 6, backend=backend) == out[0, len(ids) :].tolist()
