"""xLSTM: config translation (the tiny checkpoint's, the hub's config.json), refusals, and the variants the hub and
xLSTMConfig allow, each equal to transformers' no-cache forward and greedy continuation."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.config import UnsupportedArchitectureError, load_config, translate_config
from recap.model.testing import forward_step, greedy_generate, tiny_hf_config

# NX-AI/xLSTM-7b's config.json, the fields recap reads (its kernel names are Triton ones: not read)
HUB_7B = {
    "architectures": ["xLSTMForCausalLM"], "model_type": "xlstm", "embedding_dim": 4096, "num_blocks": 32,
    "num_heads": 8, "vocab_size": 50304, "qk_dim_factor": 0.5, "v_dim_factor": 1.0, "ffn_proj_factor": 2.667,
    "ffn_round_up_to_multiple_of": 64, "gate_soft_cap": 15.0, "output_logit_soft_cap": 30.0, "norm_eps": 1e-6,
    "eps": 1e-6, "use_bias": False, "norm_reduction_force_float32": True, "weight_mode": "single",
    "chunkwise_kernel": "chunkwise--triton_xl_chunk", "sequence_kernel": "native_sequence__triton",
    "step_kernel": "triton", "mode": "inference", "chunk_size": 64, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}  # fmt: skip


def test_tiny_checkpoint_config(tiny_checkpoint) -> None:  # noqa: ANN001
    cfg = load_config(tiny_checkpoint("xlstm"))
    x = cfg.xlstm
    assert cfg.layer_types == ("mlstm",) * 3 and cfg.mlp_types == ("none",) * 3 and not cfg.has_attention
    assert x is not None and (x.num_heads, x.qk_head_dim, x.v_head_dim, x.ffn_size) == (4, 8, 16, 192)
    assert [(s.name, s.shape, s.dtype) for s in cfg.state_specs(0)] == [("mlstm", (4, 8 * 16 + 8 + 1), torch.float32)]
    assert cfg.logits_soft_cap == 30.0 and x.gate_soft_cap == 15.0


def test_hub_config_7b() -> None:
    cfg = translate_config(HUB_7B)
    x = cfg.xlstm
    assert cfg.num_layers == 32 and cfg.hidden_size == 4096 and x is not None
    assert (x.qk_dim, x.v_dim, x.qk_head_dim, x.v_head_dim, x.ffn_size) == (2048, 4096, 256, 512, 10944)
    assert (x.weight_mode, cfg.tie_word_embeddings, cfg.eos_token_id) == ("single", False, 2)
    assert cfg.state_bytes_per_slot(torch.bfloat16) == 32 * 8 * (256 * 512 + 256 + 1) * 4


def test_fused_and_defaults() -> None:
    """weight_mode fused; fields left out take xLSTMConfig's defaults (hidden_size naming the width)."""
    raw = {"architectures": ["xLSTMForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2, "vocab_size": 100,
           "weight_mode": "fused"}  # fmt: skip
    x = translate_config(raw).xlstm
    assert x is not None and (x.num_heads, x.qk_dim, x.v_dim, x.weight_mode, x.gate_soft_cap) == (
        8,
        128,
        256,
        "fused",
        15.0,
    )


@pytest.mark.parametrize(("change", "match"), [({"weight_mode": "packed"}, "weight_mode 'packed'"),
                                                ({"num_heads": 3}, "not divisible by 3 heads")])  # fmt: skip
def test_unmatched_modes_are_refused(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=match):
        translate_config({**HUB_7B, **change})


def _build(overrides: dict) -> torch.nn.Module:
    """transformers' model with random gate weights (its init zeroes them: gates that ignore the input). Its
    _init_weights fails on weight_mode "fused" (a bias shape mismatch in transformers 5.23), so a fused model
    is built without it and every weight drawn here."""
    import transformers as tf
    from transformers.models.xlstm.modeling_xlstm import xLSTMPreTrainedModel

    cfg = tiny_hf_config("xlstm", **overrides)
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    fused = overrides.get("weight_mode") == "fused"
    with mock.patch.object(xLSTMPreTrainedModel, "_init_weights", lambda self, m: None) if fused else nullcontext():
        model = tf.xLSTMForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=g) * 0.1)
                if "gate" in name:  # input gates around -1, forget gates around 3 (transformers' -10 and 3..6)
                    p.add_(torch.randn(p.shape, generator=g) + 1.0)
            elif fused or "gate" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "gate" in name else 0.1))
    return model


def _load_hf(path: Path, fused: bool) -> torch.nn.Module:
    import transformers as tf
    from transformers.models.xlstm.modeling_xlstm import xLSTMPreTrainedModel

    with mock.patch.object(xLSTMPreTrainedModel, "_init_weights", lambda self, m: None) if fused else nullcontext():
        return tf.xLSTMForCausalLM.from_pretrained(path).eval()


# what hub checkpoints set, and what xLSTMConfig allows
VARIANTS = [
    {},  # the hub's shape: single weights, qk 0.5, caps 15 / 30
    {"weight_mode": "fused"},
    {"use_bias": True, "tie_word_embeddings": True},  # biases everywhere; transformers never ties xLSTM's head
    {"qk_dim_factor": 1.0, "v_dim_factor": 0.5, "eps": 1e-2, "gate_soft_cap": 4.0, "output_logit_soft_cap": 2.0},
    {"norm_reduction_force_float32": False, "num_heads": 2, "chunk_size": 64, "norm_eps": 1e-5},
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_variants_match_transformers(overrides: dict, tmp_path: Path) -> None:
    from recap.backends import prepare
    from recap.model.loader import load_model

    fused = overrides.get("weight_mode") == "fused"
    _build(overrides).save_pretrained(tmp_path)
    lm = load_model(tmp_path)
    backend = prepare(lm)
    ids = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = _load_hf(tmp_path, fused)
    with torch.no_grad():  # 45 tokens: transformers' chunkwise kernel (16-token chunks), then its step loop
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, [], state_slot=1)], backend)
    logits = lm.model.compute_logits(hidden)
    scale = ref.abs().max()
    assert scale > 0.5
    assert (logits - ref).abs().max() <= 1e-4 * max(1.0, float(scale))
    with torch.no_grad():  # no cache: transformers sizes its cache by the config's rounded widths, not the layer's
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False,
        )  # fmt: skip
    assert greedy_generate(lm.model, ids, 6, backend=backend) == out[0, len(ids) :].tolist()
