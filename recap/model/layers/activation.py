"""Activations by their HF config name (`hidden_act`, `mlp_hidden_act`), as transformers' ACT2FN defines them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Nemotron's MLP; HF "relu2")."""
    return F.relu(x).square_()  # relu(.) is a fresh tensor


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """HF "gelu_fast": the tanh approximation written with x * 0.7978845608 (1 + 0.044715 x^2)."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_fast": gelu_fast,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "relu2": relu2,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name` in an HF config; an unknown name is a ValueError naming it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
