"""Inkling's feed-forwards: a MoE whose shared experts sit in the router's softmax as a sink, and a dense SwiGLU
with a learned output scale.

Routing (fp32): logits = x W^T over E routed + S shared experts; the top-k routed experts by sigmoid(logit) +
e_score_correction_bias; weights = sigmoid of the k chosen and the S shared logits, normalized over those
k + S, times routed_scaling_factor * global_scale. The routed experts (stacked 3-D weights) take the first k
weights, shared expert s its own: out = sum_k w_k expert_k(x) + sum_s w_s shared_s(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.layers.activation import activation
from recap.model.layers.linear import empty_param
from recap.model.layers.mlp import MLP, split_gate_up
from recap.model.layers.moe import StackedExperts


class ScaledMLP(MLP):
    """A dense SwiGLU times a learned scalar (`global_scale` [1])."""

    def __init__(self, hidden_size: int, cfg: MLPConfig, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, cfg, dtype)
        self.global_scale = empty_param(1, dtype=dtype)

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * self.global_scale


class SinkRouter(nn.Module):
    """`weight` [E + S, D], `global_scale` [1] and `e_score_correction_bias` [E] (fp32, as transformers keeps
    them)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = empty_param(cfg.num_experts + cfg.shared_sink, hidden_size, dtype=dtype)
        self.global_scale = empty_param(1, dtype=torch.float32)
        self.e_score_correction_bias = empty_param(cfg.num_experts, dtype=torch.float32)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k + S] fp32: the chosen experts', then the shared ones'; expert ids [T, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        routed, shared = logits[:, : cfg.num_experts], logits[:, cfg.num_experts :]
        choice = torch.sigmoid(routed) + self.e_score_correction_bias
        experts = choice.topk(cfg.top_k, dim=-1).indices
        scores = torch.sigmoid(torch.cat([routed.gather(1, experts), shared], dim=-1))
        weights = scores / scores.sum(dim=-1, keepdim=True)
        return weights * (cfg.routed_scaling_factor * self.global_scale), experts


class SharedExpertStack(nn.Module):
    """S gated experts as 3-D weights: `gate_proj`, `up_proj` [S, I, D] (or one `gate_up_proj` [S, 2I, D] with
    alternating rows, when the config's gate/up rows are interleaved), `down_proj` [S, D, I]."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        s, i = cfg.shared_sink, cfg.intermediate_size
        self.interleaved = cfg.interleaved_gate_up
        if self.interleaved:
            self.gate_up_proj = empty_param(s, 2 * i, hidden_size, dtype=dtype)
        else:
            self.gate_proj = empty_param(s, i, hidden_size, dtype=dtype)
            self.up_proj = empty_param(s, i, hidden_size, dtype=dtype)
        self.down_proj = empty_param(s, hidden_size, i, dtype=dtype)
        self.act = activation(cfg.activation)

    def _gate_up(self, x: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            return split_gate_up(F.linear(x, self.gate_up_proj[s]), True)
        return F.linear(x, self.gate_proj[s]), F.linear(x, self.up_proj[s])

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], weights [T, S] -> sum_s weights[:, s] * expert_s(x) (summed in fp32)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for s in range(self.down_proj.shape[0]):
            gate, up = self._gate_up(x, s)
            out += F.linear(self.act(gate) * up * weights[:, s : s + 1], self.down_proj[s]).float()
        return out.to(x.dtype)


class SinkMoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if not cfg.shared_sink or cfg.expert_layout != "stacked" or cfg.scoring != "sigmoid":
            raise ValueError("a sink MoE needs shared_sink experts, stacked experts and sigmoid scoring")
        self.cfg = cfg
        self.gate = SinkRouter(hidden_size, cfg, dtype)
        self.experts = StackedExperts(hidden_size, cfg, dtype)
        self.shared_experts = SharedExpertStack(hidden_size, cfg, dtype)

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        weights, experts = self.gate.route(x)
        k = self.cfg.top_k
        out = self.experts.run(x, experts, weights[:, :k].to(x.dtype))
        return out + self.shared_experts(x, weights[:, k:].to(x.dtype))
