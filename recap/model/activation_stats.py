"""Activation statistics for an importance matrix: per linear layer, the mean of x_j^2 over calibration tokens for
each input channel j (what llama.cpp's llama-imatrix collects), written to a safetensors file.

Definitions. For a Linear with weight [out, in], its row of the matrix is imatrix_j = (1 / T) sum_t x_tj^2 over
the T token rows the layer saw (x: the layer's input, fp32 sums in fp64). A routed expert's layers (ExpertList
MLPs) see only the tokens routed to them, so each expert gets its own row over its own T; an expert no token
reached has T = 0 and is left out of the file (it then fits as it would without one: model/importance.py).

The model runs in full precision on its reference path (the layers as load_model builds them, no backend
prepared): a forward hook on every Linear module adds each call's inputs. Text goes in as consecutive chunks of
`ctx` tokens, each its own sequence from position 0 with fresh caches.

File: tensors keyed by the layer's parameter name (`layers.3.mixer.in_proj.weight`), each [in] fp32; metadata
"format" (FORMAT), "counts" (JSON: name -> T), "tokens", "chunks", "ctx".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.models.base import CausalLM

FORMAT = "recap-imatrix-1"
BLOCK = 16  # the caches' block size for the calibration forward (any works: one sequence, no sharing)


@dataclass
class ActivationStats:
    """Running sums per layer (parameter name): sum of x_j^2 [in] fp64 and the token rows counted."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    chunks: int = 0

    def add(self, name: str, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        if name not in self.sums:
            self.sums[name] = torch.zeros(rows.shape[1], dtype=torch.float64)
            self.counts[name] = 0
        self.sums[name] += rows.square().sum(0)
        self.counts[name] += rows.shape[0]

    def means(self) -> dict[str, torch.Tensor]:
        """name -> mean x_j^2 [in] fp32, for each layer that saw at least one token."""
        return {n: (s / self.counts[n]).float() for n, s in self.sums.items() if self.counts[n] > 0}


def linear_layers(model: nn.Module) -> dict[str, Linear]:
    """Every Linear module of `model` by its weight's parameter name (a tied head is not a module: not listed)."""
    return {f"{name}.weight" if name else "weight": m for name, m in model.named_modules() if isinstance(m, Linear)}


def _hook(stats: ActivationStats, name: str):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        stats.add(name, x)

    return hook


def prefill(model: CausalLM, ids: Sequence[int]) -> torch.Tensor:
    """One sequence from position 0 through the model's forward with fresh caches -> final hidden [T, D]."""
    blocks = list(range(1, 2 + len(ids) // BLOCK))  # block 0 is the null block
    caches = ModelCaches.allocate(model.config, len(blocks) + 1, BLOCK, 2, model.dtype,
                                  num_window_blocks=len(blocks) + 1)  # fmt: skip
    cfg = model.config
    batch = build_forward_batch([SeqSpec(list(ids), 0, blocks, state_slot=1)], block_size=BLOCK,
                                chunk_size=cfg.ssm_chunk_size, with_attention=bool(cfg.full_attention_layers),
                                with_ssm=cfg.has_ssm, with_window=bool(cfg.window_layers))  # fmt: skip
    return model(batch, caches)


def collect(model: CausalLM, chunks: Iterable[Sequence[int]]) -> ActivationStats:
    """Run `model` over each chunk of token ids (and its head over every position, as scoring the text would) with
    a hook on every Linear -> the layers' sums."""
    stats = ActivationStats()
    handles = [m.register_forward_pre_hook(_hook(stats, n), with_kwargs=True) for n, m in linear_layers(model).items()]
    try:
        with torch.inference_mode():
            for ids in chunks:
                hidden = prefill(model, ids)
                if model.config.tie_word_embeddings:  # the tied head is no module: its inputs are the hidden rows
                    stats.add("lm_head.weight", hidden)
                model.compute_logits(hidden)
                stats.tokens += len(ids)
                stats.chunks += 1
    finally:
        for h in handles:
            h.remove()
    return stats


def token_chunks(ids: Sequence[int], ctx: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive chunks of `ctx` ids (a shorter tail dropped, as llama-imatrix drops it); at most max_chunks."""
    if ctx < 1:
        raise ValueError(f"ctx must be positive, got {ctx}")
    n = len(ids) // ctx if max_chunks is None else min(len(ids) // ctx, max_chunks)
    if n < 1:
        raise ValueError(f"{len(ids)} tokens make no chunk of {ctx}")
    return [list(ids[i * ctx : (i + 1) * ctx]) for i in range(n)]


def save(stats: ActivationStats, path: str | Path, ctx: int) -> Path:
    """Write the means and counts (module docstring's file) -> the path."""
    from safetensors.torch import save_file

    means = stats.means()
    meta = {"format": FORMAT, "counts": json.dumps({n: stats.counts[n] for n in means}), "tokens": str(stats.tokens),
            "chunks": str(stats.chunks), "ctx": str(ctx)}  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in means.items()}, str(path), metadata=meta)
    return path
