"""The MoE layer against transformers' own MoE blocks (weights copied in), for every routing kind recap loads.

Each case builds one HF block from a tiny config, copies its weights into recap's SparseMoE (per-expert
list layout and stacked layout) and compares outputs on random tokens. The routing alone is also checked
against a plain per-token loop.
"""

from __future__ import annotations

import pytest
import torch

from recap.model.config import MoEConfig
from recap.model.layers.moe import SparseMoE, route

H, T = 32, 37


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in module.named_buffers():
            if "correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def _load(moe: SparseMoE, weights: dict[str, torch.Tensor]) -> None:
    params = moe.state_dict(keep_vars=True)
    assert set(params) == set(weights), set(params) ^ set(weights)
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)


def _experts(prefix: str, layout: str, gate_up: torch.Tensor | None, up: torch.Tensor | None,
             down: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """HF's stacked expert tensors in recap's `layout`."""
    if layout == "stacked":
        first = {f"{prefix}.gate_up_proj": gate_up} if gate_up is not None else {f"{prefix}.up_proj": up}
        return first | {f"{prefix}.down_proj": down}
    out = {}
    for e in range(down.shape[0]):
        if gate_up is not None:
            g, u = gate_up[e].chunk(2, dim=0)
            out |= {f"{prefix}.{e}.gate_proj.weight": g, f"{prefix}.{e}.up_proj.weight": u}
        else:
            out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out


def _compare(ours: SparseMoE, hf: torch.nn.Module, seed: int) -> None:
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = hf(x)
        want = (want[0] if isinstance(want, tuple) else want).reshape(T, H)
    got = ours(x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["list", "stacked"])
@pytest.mark.parametrize(
    ("groups", "topk_groups", "renorm", "scaling", "latent"),
    [(1, 1, True, 1.0, None), (4, 2, True, 2.5, None), (2, 1, False, 1.0, None), (1, 1, True, 1.0, 16)],
)
def test_nemotron_h_sigmoid_grouped_routing(layout, groups, topk_groups, renorm, scaling, latent) -> None:  # noqa: ANN001
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    hf_cfg = NemotronHConfig(
        hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=20, n_group=groups, topk_group=topk_groups, norm_topk_prob=renorm,
        routed_scaling_factor=scaling, moe_latent_size=latent, mlp_hidden_act="relu2",
    )  # fmt: skip
    hf = NemotronHMoE(hf_cfg).eval()
    _fill(hf, 1)
    cfg = MoEConfig(
        num_experts=8, top_k=3, intermediate_size=24, activation="relu2", gated=False, scoring="sigmoid",
        renormalize=renorm, correction_bias=True, num_groups=groups, topk_groups=topk_groups,
        routed_scaling_factor=scaling, expert_layout=layout, shared_intermediate_size=20, latent_size=latent,
    )  # fmt: skip
    ours = SparseMoE(H, cfg, torch.float32, router_name="gate")
    w = {"gate.weight": hf.gate.weight, "gate.e_score_correction_bias": hf.gate.e_score_correction_bias,
         "shared_experts.up_proj.weight": hf.shared_experts.up_proj.weight,
         "shared_experts.down_proj.weight": hf.shared_experts.down_proj.weight}  # fmt: skip
    if latent:
        w |= {f"fc{i}_latent_proj.weight": getattr(hf, f"fc{i}_latent_proj").weight for i in (1, 2)}
    w |= _experts("experts", layout, None, hf.experts.up_proj, hf.experts.down_proj)
    _load(ours, w)
    _compare(ours, hf, 2)


@pytest.mark.parametrize("layout", ["list", "stacked"])
@pytest.mark.parametrize("renorm", [True, False])
def test_qwen_softmax_topk_with_gated_shared_expert(layout, renorm) -> None:  # noqa: ANN001
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf_cfg = Qwen3NextConfig(hidden_size=H, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                             shared_expert_intermediate_size=40, norm_topk_prob=renorm)  # fmt: skip
    hf = Qwen3NextSparseMoeBlock(hf_cfg).eval()
    _fill(hf, 3)
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=24, renormalize=renorm, expert_layout=layout,
                    shared_intermediate_size=40, shared_gate=True)  # fmt: skip
    ours = SparseMoE(H, cfg, torch.float32, router_name="gate", shared_name="shared_expert")
    w = {"gate.weight": hf.gate.weight, "shared_expert_gate.weight": hf.shared_expert_gate.weight}
    for p in ("gate_proj", "up_proj", "down_proj"):
        w[f"shared_expert.{p}.weight"] = getattr(hf.shared_expert, p).weight
    w |= _experts("experts", layout, hf.experts.gate_up_proj, None, hf.experts.down_proj)
    _load(ours, w)
    _compare(ours, hf, 4)


def test_granite_softmax_over_topk_logits() -> None:
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE

    hf_cfg = GraniteMoeHybridConfig(hidden_size=H, num_local_experts=5, num_experts_per_tok=2, mamba_n_heads=8,
                                    intermediate_size=24)  # fmt: skip
    hf = GraniteMoeHybridMoE(hf_cfg).eval()
    _fill(hf, 5)
    cfg = MoEConfig(num_experts=5, top_k=2, intermediate_size=24, renormalize=True, expert_layout="stacked")
    ours = SparseMoE(H, cfg, torch.float32)
    _load(ours, {"router.weight": hf.router.weight, "experts.gate_up_proj": hf.experts.gate_up_proj,
                 "experts.down_proj": hf.experts.down_proj})  # fmt: skip
    _compare(ours, hf, 6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_matches_a_per_token_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(23, 12, generator=g)
    bias = torch.randn(12, generator=g) * 0.5
    cfg = MoEConfig(num_experts=12, top_k=3, intermediate_size=4, scoring="sigmoid", renormalize=True,
                    correction_bias=True, num_groups=4, topk_groups=2, routed_scaling_factor=1.5)  # fmt: skip
    weights, experts = route(logits, cfg, bias)
    for t in range(23):
        scores = torch.sigmoid(logits[t])
        choice = (scores + bias).tolist()
        groups = sorted(range(4), key=lambda gi: -sum(sorted(choice[gi * 3 : gi * 3 + 3])[-2:]))[:2]
        allowed = [e for e in range(12) if e // 3 in groups]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:3]
        assert sorted(experts[t].tolist()) == sorted(chosen)
        w = scores[chosen] / scores[chosen].sum() * 1.5
        got = dict(zip(experts[t].tolist(), weights[t].tolist()))
        assert [round(got[e], 5) for e in chosen] == [round(v, 5) for v in w.tolist()]


def test_bad_moe_configs_are_errors() -> None:
    with pytest.raises(ValueError, match="top-5"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(ValueError, match="scoring"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=8, scoring="relu")
    with pytest.raises(ValueError, match="groups"):
        MoEConfig(num_experts=6, top_k=2, intermediate_size=8, num_groups=4)
    with pytest.raises(ValueError, match="shared"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=8, shared_gate=True)
