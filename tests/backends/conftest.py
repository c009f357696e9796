"""Tiny checkpoints the graph tests add to tests/conftest.py's: MLP activations and layouts the families' tiny
configs do not have (Nemotron-H without its MoE layers: its non-gated MLP with relu2, gelu_tanh or gelu; gated
MLPs are Bamba's silu, and the activation ops' tests cover the others), and Granite-4.0-H without its MoE (the
shared MLP alone, as Granite-4.0-H-1B), with NoPE or RoPE attention."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# name -> (architecture short name, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron_h_relu2": ("nemotron_h", {"layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
                                        "mlp_hidden_act": "relu2"}),
    "nemotron_h_gelu_tanh": ("nemotron_h", {"layers_block_type": ["mamba", "mlp", "attention", "mlp"],
                                            "mlp_hidden_act": "gelu_pytorch_tanh"}),
    "nemotron_h_gelu": ("nemotron_h", {"layers_block_type": ["attention", "mlp", "mamba", "mlp"],
                                       "mlp_hidden_act": "gelu"}),
    "nemotron_h_gelu_fast": ("nemotron_h", {"layers_block_type": ["mamba", "mlp"], "mlp_hidden_act": "gelu_fast"}),
    # Granite-4.0-H-1B's layout: the shared MLP alone (no experts), muP multipliers from the tiny config
    "granite_dense": ("granite_hybrid", {"num_local_experts": 0, "num_experts_per_tok": 0}),
    "granite_dense_rope": ("granite_hybrid", {"num_local_experts": 0, "num_experts_per_tok": 0,
                                              "position_embedding_type": "rope",
                                              "layer_types": ["attention", "mamba", "attention", "mamba"]}),
}  # fmt: skip


@pytest.fixture(scope="session")
def graph_checkpoint(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """A VARIANTS name or a tiny arch -> its checkpoint folder, built on first use."""
    from recap.model.testing import make_tiny_checkpoint

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in VARIANTS:
            return tiny_checkpoint(name)
        if name not in built:
            arch, overrides = VARIANTS[name]
            built[name] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(name), **overrides)
        return built[name]

    return get
