"""An importance matrix at load (`--quantization-imatrix FILE`): int4 and int4_k weights fitted with each input
channel's mean squared activation (model/activation_stats.py writes the file; `recap imatrix` runs it).

Why: the int4 fits weigh each weight's squared error by c_i = rms(group) + |w_i| (llama.cpp's Q4_K without an
importance matrix). The error a layer adds to its output is sum_j (dw_j x_j)^2, whose expectation over tokens is
sum_j dw_j^2 E[x_j^2]: a weight on a channel that carries large activations matters more. With a matrix the fit
weighs c_i sqrt(imatrix_j): the square root softens the matrix (docs/quantization.md, "Importance matrices for
int4": the full ratio, spanning up to 10^6 on relu2 down projections, lowered most layers' output error on
held-out tokens yet raised the draft model's perplexity by 0.11%, 5 standard errors; its square root is neutral
on both shipped models, as llama.cpp's matrix is on the draft; Q4_K's own shape imatrix_j sqrt(sigma^2 + w_i^2)
and floors of 1e-3 or 1e-2 hurt as the full ratio did).

A layer's row goes to quantize_int4 over its maximum (the least-squares fits are unchanged by one factor per
layer, and a uniform row becomes exactly 1: the plain fit bit for bit), floored at FLOOR so that a group of
channels no token reached still has a defined fit, then its square root. A file naming a layer the model lacks,
or a row of another width, is refused before any weight is read (ImportanceMatrixError naming the layer); int4
layers the file lacks fit without it, counted in one log line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from recap.model.activation_stats import FORMAT, linear_layers
from recap.model.layers.linear import Linear

logger = logging.getLogger(__name__)
INT4_FORMATS = ("int4", "int4_k")
FLOOR = 1e-6  # the least relative importance a channel keeps (1e-3 once the square root is taken)


class ImportanceMatrixError(ValueError):
    """An importance matrix file that does not fit the model or the quantization (names the layer or the flag)."""


@dataclass(frozen=True)
class ImportanceMatrix:
    """Per layer (parameter name) the mean x_j^2 [in] fp32 and the token rows it was taken over."""

    means: dict[str, torch.Tensor]
    counts: dict[str, int]
    path: Path


def read_importance(path: str | Path) -> ImportanceMatrix:
    """The file activation_stats.save wrote; ImportanceMatrixError for another file or a bad row."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            means = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except (OSError, ValueError, RuntimeError) as e:  # safetensors' own errors are RuntimeError subclasses
        raise ImportanceMatrixError(f"{path}: not a readable importance matrix ({e})") from e
    if meta.get("format") != FORMAT:
        raise ImportanceMatrixError(f"{path}: format {meta.get('format')!r}, not {FORMAT!r} (`recap imatrix`'s)")
    counts = json.loads(meta.get("counts", "{}"))
    for name, row in means.items():
        if row.dim() != 1 or not bool(torch.isfinite(row).all()) or bool((row < 0).any()):
            raise ImportanceMatrixError(f"{path}: {name!r} is not a row of finite non-negative means")
    return ImportanceMatrix(means, {n: int(counts.get(n, 0)) for n in means}, path)


def layer_importance(net: nn.Module, path: str | Path, quantization: str | None,
                     prequantized: bool = False) -> dict[Linear, torch.Tensor]:  # fmt: skip
    """Each Linear of `net` the file covers -> its row for quantize_int4 (the square root of the row over its
    maximum, floored: module docstring). Called before any weight is read. Refuses (ImportanceMatrixError) a
    quantization other than int4 / int4_k, a pre-quantized checkpoint (its codes are kept, not fitted), and a file
    row whose name is no Linear of the model or whose width is not the layer's inputs."""
    if quantization not in INT4_FORMATS:
        raise ImportanceMatrixError(f"an importance matrix weighs the int4 fits: quantization {INT4_FORMATS}, not "
                                    f"{quantization!r}")  # fmt: skip
    if prequantized:
        raise ImportanceMatrixError("an importance matrix weighs a fit of full-precision weights, not a "
                                    "pre-quantized checkpoint's codes")  # fmt: skip
    imatrix = read_importance(path)
    layers = linear_layers(net)
    out: dict[Linear, torch.Tensor] = {}
    for name, row in imatrix.means.items():
        layer = layers.get(name)
        if layer is None:
            raise ImportanceMatrixError(f"{imatrix.path}: {name!r} is no linear layer of this model")
        if row.shape[0] != layer.in_features:
            raise ImportanceMatrixError(f"{imatrix.path}: {name!r} has {row.shape[0]} channels, the layer "
                                        f"{layer.in_features} inputs")  # fmt: skip
        top = float(row.max())
        if top > 0:  # a row of zeros (inputs always 0) says nothing: the plain fit
            out[layer] = torch.clamp_min(row / top, FLOOR).sqrt()  # softened: module docstring
    return out


def log_coverage(importance: dict[Linear, torch.Tensor], net: nn.Module, path: str | Path) -> None:
    """One line once the model is loaded: how many int4 layers the matrix weighed, and how many fit without it."""
    quantized = [m for m in linear_layers(net).values() if m.backend in INT4_FORMATS]
    lacking = sum(1 for m in quantized if m not in importance)
    logger.info("importance matrix %s: %d int4 layers fitted with it, %d without (not in the file)", path,
                len(quantized) - lacking, lacking)  # fmt: skip
