"""The backend seam: how the runner executes a model on one device.

A backend prepares a loaded model (the linear layers' implementation, native kernels on or off, where the
weights live), places the KV/state pools (`cache_zeros`, ModelCaches.allocate's allocator), names the kernel
set the step's ForwardBatch carries (every layer calls `batch.kernels.<op>`), and runs a step
(`forward`: the model's forward, or a replay of a captured step). The model holds no device branch: a
backend drives its parts through their public switches (`Linear.set_backend`, `set_native`, `Linear.impl`,
`set_norm_kernel`, `set_add_norm_kernel`, `set_rope_kernel`, `set_moe_kernel`) and the decode-capture protocol
(recap/model/capture.py). The runner owns one backend and runs every step through it; a device is one
more Backend subclass.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from recap.backends.graph_memory import StepLimits
from recap.kernels.kernel_set import Kernel, KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches, TensorAllocator
from recap.model.layers.embedding import Embedding, int8_tiles_of
from recap.model.layers.linear import Linear
from recap.model.models import CausalLM
from recap.model.quant import QUANTIZATIONS
from recap.process.heap import return_free_heap


@runtime_checkable
class NativeSwitch(Protocol):
    """A part with native decode kernels (linear layers, RMS norms, attention, Mamba2 mixers)."""

    def set_native(self, on: bool) -> None: ...


def model_parts(model: CausalLM) -> list[nn.Module]:
    """Every module of the model, and its tied head (a view of the embedding's weight, not a submodule)."""
    parts = list(model.modules())
    if model.config.tie_word_embeddings:
        parts.append(model.head())
    return parts


def set_linear_backend(parts: list[nn.Module], backend: str, native: bool | None = None,
                       int8_embeddings: bool = True, formats: Mapping[nn.Module, str] | None = None) -> None:
    """Every Linear of `parts` to `backend`: "torch" (reference), "onednn", "int8" or "int4" (layers/linear.py),
    or to its own backend in `formats` (the output head at int8 under int4: model/head_format.py), with the
    native kernels `native` (None: as they are), one layer at a time: each lays its weight out in its one
    serving layout and frees the parameter before the next (Linear.set_backend), so the peak is the model plus
    one layer. With a quantized backend the embeddings then become int8 rows (layers/embedding.py) unless
    `int8_embeddings` is False (its memory and perplexity cost: docs/performance.md, docs/default_model.md)."""
    own = formats or {}
    tables = {id(m.weight): m for m in parts if isinstance(m, Embedding) and not m.released}
    tied = {tables[id(m.weight)]: m for m in parts
            if isinstance(m, Linear) and m.shares_weight and not m.released and id(m.weight) in tables}  # fmt: skip
    for m in parts:
        if isinstance(m, Linear):
            m.set_backend(own.get(m, backend), native)
            return_free_heap()  # the replaced parameter, before the next layer allocates its layout
    if int8_embeddings and backend in QUANTIZATIONS:  # after the linears (a tied head: its tiles are the rows)
        for m in parts:
            if isinstance(m, Embedding):
                m.quantize_int8(int8_tiles_of(tied.get(m)))
                return_free_heap()


@runtime_checkable
class NormKernelSwitch(Protocol):
    """A norm that runs the kernel set's fused norm kernel where one is given (model/layers/norm.py)."""

    def set_norm_kernel(self, kernel: Kernel | None) -> None: ...


def switch_norm_kernel(parts: list[nn.Module], kernel: Kernel | None) -> None:
    """Every norm of `parts` on `kernel` (None: their torch ops)."""
    for m in parts:
        if isinstance(m, NormKernelSwitch):
            m.set_norm_kernel(kernel)


@runtime_checkable
class AddNormKernelSwitch(Protocol):
    """A residual norm that takes the residual add feeding it through the kernel set's fused add + norm where one
    is given (model/layers/norm.py's `add_forward`)."""

    def set_add_norm_kernel(self, kernel: Kernel | None) -> None: ...


@runtime_checkable
class RopeKernelSwitch(Protocol):
    """An attention layer that prepares q/k through the kernel set's fused kernel where one is given
    (model/layers/qk_rope.py)."""

    def set_rope_kernel(self, kernel: Kernel | None) -> None: ...


@runtime_checkable
class MoEKernelSwitch(Protocol):
    """Routed experts that run the kernel set's fused experts where given and they can (model/layers/moe.py)."""

    def set_moe_kernel(self, kernel: Kernel | None) -> None: ...


def switch_fused_kernels(parts: list[nn.Module], kernels: KernelSet) -> None:
    """Every norm of `parts` on the kernel set's `rms_norm` (the residual norms' adds on its `add_rms_norm`), every
    attention layer's q/k preparation on its `rope_qk`, every routed-expert module on its `moe_experts` (None:
    their torch ops / per-expert loops)."""
    switch_norm_kernel(parts, kernels.rms_norm)
    for m in parts:
        if isinstance(m, AddNormKernelSwitch):
            m.set_add_norm_kernel(kernels.add_rms_norm)
        if isinstance(m, RopeKernelSwitch):
            m.set_rope_kernel(kernels.rope_qk)
        if isinstance(m, MoEKernelSwitch):
            m.set_moe_kernel(kernels.moe_experts)


def switch_native(parts: list[nn.Module], on: bool) -> None:
    """Every part with native decode kernels on or off (bound again to the weights' current addresses)."""
    for m in parts:
        if isinstance(m, NativeSwitch):
            m.set_native(on)


# Which backend prepared each live model last: a backend's captured state (decode graphs bound to kernel and
# weight addresses) is stale once another backend has prepared the model again.
_PREPARED_BY: weakref.WeakKeyDictionary[nn.Module, Backend] = weakref.WeakKeyDictionary()


class Backend(ABC):
    """How one model runs on one device; the runner builds one, prepares its model, then runs every step
    through `forward` with batches built for `kernels`."""

    name: ClassVar[str]
    kernels: KernelSet  # the step's kernel set (build_forward_batch(kernels=...))
    head_backend: str | None = None  # the output head's linear backend where not the others' (model/head_format.py)

    def prepare(self, model: CausalLM) -> None:
        """Make `model` run this backend's way (call after loading its weights, again after reloading them).
        The model is then this backend's to run (`serves`) until another backend prepares it."""
        self._prepare(model)
        switch_fused_kernels(model_parts(model), self.kernels)  # the kernel set's, for every backend
        _PREPARED_BY[model] = self
        return_free_heap()  # the parameters and copies the layouts replaced: back to the OS before serving

    def serves(self, model: CausalLM) -> bool:
        """Whether this backend prepared `model` last."""
        return _PREPARED_BY.get(model) is self

    @abstractmethod
    def _prepare(self, model: CausalLM) -> None: ...

    def max_verify_tokens(self, model: CausalLM, caches: ModelCaches) -> int | None:
        """The most tokens of a step with drafts this backend runs `model` over `caches` as cheaply as it can (the
        CPU backend's captured verify graph, where the model's verify steps take one); the scheduler keeps a step's
        rows and drafts within it (core/speculation.py). None: no such limit, every step size runs the same path."""
        return None

    def graph_bytes(self, model: CausalLM, limits: StepLimits) -> int:
        """The bytes the captured steps this backend may make for `model` will hold, from its config and `limits`
        before any is captured (backends/graph_memory.py), for the memory plan. Default: it captures none."""
        return 0

    def cache_zeros(self) -> TensorAllocator | None:
        """The allocator of the KV/state pools (ModelCaches.allocate's `zeros`); None: torch.zeros."""
        return None

    def shape_rows(self, specs: Sequence[SeqSpec]) -> Sequence[SeqSpec]:
        """The step's rows as this backend runs them, before the batch is built: a backend that replays steps of
        a few captured shapes pads a step to one (padding rows, PAD_SLOT_ID tables). Default: as they are."""
        return specs

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The step's final hidden states [T, D]; updates `caches` as the model's forward does."""
        return model(batch, caches)

    def forward_greedy(
        self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the argmax token of each sampled row (batch.sample_rows' order) as int64 ids [R] on the
        model's device, not read on the host (the runner decides when: runner/host_copy.py): for a step whose
        sampled rows all take the argmax of their raw logits and nothing else of them (runner/sampler.py's
        takes_argmax). The reference: the head and argmax on the forward's output; a backend that captures steps
        folds them into the capture (backends/cuda.py)."""
        hidden = self.forward(model, batch, caches)
        if not batch.sample_rows:
            return hidden, torch.empty(0, dtype=torch.int64, device=hidden.device)
        return hidden, model.greedy_tokens(hidden[batch.logits_indices]).to(torch.int64)
