"""The SwiGLU clamp (GLM-5.3-Flash's swiglu_limit) in the dense MLP and in the MoE's routed and shared experts,
against transformers' Glm5NextTextMLP and Glm5NextTextMoE (sigmoid router with correction bias, grouped
top-k, routed scaling, stacked experts); inputs large enough that the clamp bites."""

from __future__ import annotations

import pytest
import torch

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.layers.mlp import MLP
from recap.model.layers.moe import SparseMoE

hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")


def _cfg() -> object:
    return hf_config.Glm5NextTextConfig(hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                                        n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
                                        n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=1.5,
                                        num_hidden_layers=1, vocab_size=32)  # fmt: skip


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen))


@pytest.mark.parametrize("seed", range(3))
def test_dense_mlp_matches_transformers(seed: int) -> None:
    ref = hf.Glm5NextTextMLP(_cfg())
    _randomize(ref, seed)
    ours = MLP(16, MLPConfig(24, swiglu_limit=1.5), torch.float32)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(10 + seed))
    with torch.no_grad():
        expected = ref(x)
        assert bool((ref.gate_proj(x).abs() > 1.5).any())  # the clamp bites
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        unclamped = MLP(16, MLPConfig(24), torch.float32)
        unclamped.load_state_dict(ref.state_dict())
        assert not torch.allclose(unclamped(x), expected, atol=1e-3)


@pytest.mark.parametrize("seed", range(3))
def test_moe_matches_transformers(seed: int) -> None:
    ref = hf.Glm5NextTextMoE(_cfg())
    _randomize(ref, seed)
    moe = MoEConfig(num_experts=8, top_k=3, intermediate_size=12, scoring="sigmoid", renormalize=True,
                    correction_bias=True, num_groups=2, topk_groups=1, routed_scaling_factor=2.5,
                    expert_layout="stacked", shared_intermediate_size=12, swiglu_limit=1.5)  # fmt: skip
    ours = SparseMoE(16, moe, torch.float32, router_name="gate", shared_name="shared_experts")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(20 + seed))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x[None])[0], rtol=1e-5, atol=1e-5)
