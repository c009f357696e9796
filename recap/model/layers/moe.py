"""Sparse MoE with a softmax top-k router (Jamba).

Routing as in HF Jamba: probs = softmax(router(x)) in fp32, take the top-k experts per token and
weight their outputs by those probabilities *without* renormalizing them to sum to one.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.model.config import MLPConfig
from recap.model.layers.linear import Linear
from recap.model.layers.mlp import GatedMLP


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MLPConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.num_experts < 1 or not 0 < cfg.top_k <= cfg.num_experts:
            raise ValueError(f"bad MoE shape: {cfg.num_experts} experts, top-{cfg.top_k}")
        self.top_k = cfg.top_k
        self.router = Linear(hidden_size, cfg.num_experts, False, dtype)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, cfg.intermediate_size, cfg.activation, cfg.bias, dtype)
            for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)  # (t, e)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (t, k)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            tok, slot = torch.where(experts == e)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out
