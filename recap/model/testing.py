"""Tiny random HF checkpoints for tests anywhere (built with transformers' own classes, saved to disk).

Each family's entry in model/families.py holds its tiny config (`TINY_ARCHS`: short name -> architecture)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.families import TINY_ARCHS, family
from recap.model.models.base import CausalLM

# Every tiny config: these on top of the family's own (TinyConfig.kwargs).
TINY_COMMON: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "initializer_range": 0.1}
# A vision tower small enough to build in a test; recap skips its weights.
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A small transformers config (hidden 64, vocab 512, 2-6 layers, init range 0.1) for `arch`, a short name of
    TINY_ARCHS or an architecture (its family's TinyConfig); `overrides` go to the config (vision-language
    families: to the top-level config, and `text_config` into the text config)."""
    import transformers as tf

    tiny = family(TINY_ARCHS.get(arch, arch)).tiny
    cls = getattr(tf, tiny.hf_config)
    if tiny.vision:
        text = {**TINY_COMMON, **tiny.kwargs, **overrides.pop("text_config", {})}
        return cls(text_config=text, **(tiny.towers or {"vision_config": TINY_VISION}), **overrides)
    return cls(**{**TINY_COMMON, **tiny.kwargs, **overrides})


def make_tiny_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a random-weight `arch` model with transformers and `save_pretrained` it into `path`.

    `arch` is a short name ("mamba", "falcon_mamba", "mamba2", "bamba", "jamba") or an HF
    architecture name; `overrides` go to the transformers config. Returns `path`.
    """
    import transformers as tf

    config = tiny_hf_config(arch, **overrides)
    name = TINY_ARCHS.get(arch, arch)
    cls = getattr(tf, name)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if family(name).tiny.jitter:
        _jitter_constants(model, seed, family(name).tiny.jitter_all)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def _jitter_constants(model: torch.nn.Module, seed: int, every_constant: bool = False) -> None:
    """Add N(0, 0.1) noise to every 1-D tensor of the checkpoint (norm weights, D, dt_bias, biases, ...);
    `every_constant`: to every tensor whose entries are all equal too."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for t in model.state_dict().values():
            constant = every_constant and t.numel() > 1 and bool((t == t.flatten()[0]).all())
            if (t.dim() == 1 or constant) and t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.1)


class StepBackend(Protocol):
    """What a test step needs of a runner's backend (recap/backends/base.py's Backend)."""

    kernels: KernelSet

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor: ...


def forward_step(
    model: CausalLM, caches: ModelCaches, seqs: Sequence[SeqSpec], backend: StepBackend | None = None,
    num_draft_tokens: int = 0,
) -> tuple[torch.Tensor, ForwardBatch]:  # fmt: skip
    """Pack `seqs` into a ForwardBatch for `model` and run it (through `backend` as a runner does; None: the
    model's forward with the reference kernels): (final hidden [T, D], batch). num_draft_tokens: the step's
    draft tokens, as the runner marks a verify step (ForwardBatch.num_draft_tokens)."""
    cfg = model.config
    batch = build_forward_batch(
        seqs,
        block_size=caches.block_size,
        chunk_size=cfg.ssm_chunk_size,
        with_attention=bool(cfg.full_attention_layers),
        with_ssm=cfg.has_ssm,
        with_window=bool(cfg.window_layers),
        kernels=None if backend is None else backend.kernels,
    )
    batch.num_draft_tokens = num_draft_tokens
    return (model(batch, caches) if backend is None else backend.forward(model, batch, caches)), batch


def greedy_generate(
    model: CausalLM, prompt: Sequence[int], max_new_tokens: int, block_size: int = 16, slot: int = 1,
    backend: StepBackend | None = None,
) -> list[int]:  # fmt: skip
    """Greedy tokens for one sequence: one prefill step, then one decode step per token (update kernels); through
    `backend` as a runner does, or the model's forward."""
    total = len(prompt) + max_new_tokens
    blocks = list(range(1, 2 + total // block_size))  # block 0 is the null block
    caches = ModelCaches.allocate(
        model.config, len(blocks) + 1, block_size, slot + 1, model.dtype, num_window_blocks=len(blocks) + 1
    )
    tokens, out, context = list(prompt), [], 0
    while len(out) < max_new_tokens:
        new = tokens[context:]
        spec = SeqSpec(new, context_len=context, block_ids=blocks, state_slot=slot)
        hidden, batch = forward_step(model, caches, [spec], backend)
        logits = model.compute_logits(hidden[batch.logits_indices])
        context += len(new)
        out.append(int(logits[0].argmax()))
        tokens.append(out[-1])
    return out
