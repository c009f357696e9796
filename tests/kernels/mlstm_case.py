"""The mLSTM kernel's case for the shared SSM invariants (cases.py CASES): its inputs and its three forms."""

from __future__ import annotations

import torch

from recap.kernels.metadata import SSMMetadata
from recap.kernels.mlstm import mlstm_scan, mlstm_scan_ref, mlstm_update, state_width

Tensors = dict[str, torch.Tensor]
ML_H, ML_K, ML_V = 2, 3, 5  # heads, query/key and value channels per head
MLSTM_SHAPE = (ML_H, state_width(ML_K, ML_V))
_NAMES = ("q", "k", "v", "i", "f")


def mlstm_inputs(n: int, g: torch.Generator, h: int = ML_H, k: int = ML_K, v: int = ML_V) -> Tensors:
    """Random q, k, v and gate pre-activations (input gates on +-4, forget gates from closed to open)."""
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {"q": r(n, h, k), "k": r(n, h, k), "v": r(n, h, v), "i": r(n, h) * 2, "f": r(n, h) * 2 + 2}


def mlstm_fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):  # noqa: ANN201
    return mlstm_scan(*(inp[n] for n in _NAMES), cache, meta, sp)


def mlstm_ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):  # noqa: ANN201
    return mlstm_scan_ref(*(inp[n] for n in _NAMES), cache, meta, sp)


def mlstm_update_step(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:  # noqa: ANN001
    return mlstm_update(*(inp[n] for n in _NAMES), cache, idx, sp, pos)
