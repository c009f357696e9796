"""The CPU backend: recap's decode fast path on top of the torch backend.

- Linear layers hold one copy of each weight (layers/linear.py): fp32 weights in the native panels, which
  every row count takes (kernels/linear_rows.py); bf16 in oneDNN's packed copy; int8 weights in the native
  int8 kernel's tiles, which every row count takes (fbgemm only where the kernels do not build). Each layer is
  laid out and its parameter freed before the next (peak: the model plus one layer). RMS norms, attention's
  decode rows and Mamba2's plain decode steps take their native kernels (kernels/rms_norm.py, paged_decode.py,
  mamba2_step.py).
- The weights, the native kernels' packed copies and the KV/state pools move to transparent huge pages
  (huge_pages.py): a decode step streams them all. The memory each move or re-layout frees goes back to the
  OS as it goes (process/heap.py), so that none of it stays resident in glibc's heap.
- The layers' ops are CPU_KERNELS (kernels/cpu_kernel_set.py): the torch kernel set with the prefill steps of the
  causal conv, the gated delta rule and KDA in native C.
- Decode steps of 1 to MAX_ROWS rows replay a captured decode graph (decode_graph.py) where the model's parts
  can be captured, and run the module path otherwise; so do speculative verify steps of up to
  MAX_VERIFY_TOKENS tokens (verify_graph.py: captured per token count as such steps turn up).
"""

from __future__ import annotations

import logging
import weakref
from typing import ClassVar

import torch
from torch import nn

from recap.backends.base import model_parts, set_linear_backend, switch_native
from recap.backends.decode_graph import MAX_ROWS, DecodeGraph, capture
from recap.backends.eager import TorchBackend
from recap.backends.graph_memory import StepLimits, decode_graphs_bytes
from recap.backends.huge_pages import HUGE_PAGE_MIN_BYTES, huge_page_zeros
from recap.backends.verify_graph import MAX_VERIFY_TOKENS, VerifyGraph
from recap.kernels.cpu_kernel_set import CPU_KERNELS
from recap.kernels.linear_rows import linear_rows_available
from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches, TensorAllocator
from recap.model.capture import GraphUnsupportedError
from recap.model.layers.linear import Linear
from recap.model.models import CausalLM
from recap.process.heap import return_free_heap

logger = logging.getLogger(__name__)

# The csrc libraries this backend's parts load (linear layers, RMS norms, attention, Mamba2, decode graphs and their
# GDN step) and its kernel set's prefill kernels (conv taps, the gated delta rule, Mamba2's SSD).
NATIVE_LIBRARIES = (
    "linear_rows", "linear_int8", "rms_norm", "paged_decode", "mamba2_step", "decode_ops", "gdn_step", "conv_taps",
    "gdn_walk", "ssd_walk",
)  # fmt: skip


class NativeKernelsUnavailableError(RuntimeError):
    """The native kernels do not build here (no C compiler): the torch backend is what runs."""


class CpuBackend(TorchBackend):
    """Native decode kernels, weights and pools on huge pages, decode graphs (see the module docstring)."""

    name: ClassVar[str] = "cpu"

    def __init__(self, linear_backend: str = "onednn", head_backend: str | None = None) -> None:
        if not linear_rows_available():
            raise NativeKernelsUnavailableError("the native decode kernels do not build here; use TorchBackend")
        super().__init__(linear_backend, CPU_KERNELS, head_backend)
        self.on_huge_pages = False  # whether prepare moved the weights (the pools then follow: cache_zeros)
        # The decode graphs captured for one model and cache set, by row count (None where one could not be):
        # (weak references to that model and those caches, graphs). Dropped whenever the kernels are bound anew.
        self._graphs: tuple[weakref.ref[nn.Module], weakref.ref[ModelCaches], dict[int, DecodeGraph | None]] | None
        self._graphs = None
        self._verify_graphs: dict[int, VerifyGraph | None] = {}  # over the same model and caches as _graphs

    def _prepare(self, model: CausalLM) -> None:
        """Every linear layer on `linear_backend`, the native kernels on, then the weights moved to huge pages
        and the kernels bound again to them (a Mamba2 step bound before the move would read freed memory)."""
        parts = model_parts(model)
        formats = self.layer_formats(model)  # the output head's own backend
        set_linear_backend(parts, self.linear_backend, native=True, formats=formats)  # laid out once, natively
        switch_native(parts, True)
        self._graphs = None  # they hold the old kernels' addresses
        self.on_huge_pages = _move_weights_to_huge_pages(model, parts)
        if self.on_huge_pages:
            switch_native(parts, True)

    def graph_bytes(self, model: CausalLM, limits: StepLimits) -> int:
        """The activation buffers of the decode graphs of 1 to MAX_ROWS rows (backends/graph_memory.py); verify
        graphs, captured only with speculation, as such steps turn up, are not counted."""
        return decode_graphs_bytes(model.config, model.dtype == torch.float32, MAX_ROWS)

    def cache_zeros(self) -> TensorAllocator | None:
        """The pools on huge pages with the weights (where those moved)."""
        return huge_page_zeros if self.on_huge_pages else None

    @torch.inference_mode()
    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """A decode step the graph of its row count takes is replayed; any other step runs the modules."""
        graph: DecodeGraph | None = None
        if batch.num_tokens == batch.num_seqs <= MAX_ROWS:
            graph = self.decode_graph(model, caches, batch.num_seqs)
        elif batch.num_draft_tokens and batch.num_tokens <= MAX_VERIFY_TOKENS:
            graph = self.verify_graph(model, caches, batch.num_tokens)
        if graph is not None and graph.takes(batch):
            return graph.run(batch, caches)
        return model(batch, caches)

    def decode_graph(self, model: CausalLM, caches: ModelCaches, rows: int) -> DecodeGraph | None:
        """The decode graph of `rows` rows over `caches` (every row count captured at the first decode step over
        them; None: the model has a part the graph does not capture at that row count, logged once)."""
        if not self.serves(model):  # its graphs would call kernels bound to another preparation's memory
            raise RuntimeError(f"the {self.name} backend runs the model it prepared last; prepare this one again")
        g = self._graphs
        if g is None or g[0]() is not model or g[1]() is not caches:
            g = self._graphs = (weakref.ref(model), weakref.ref(caches), capture(model, caches, logger.info))
            self._verify_graphs = {}
        return g[2][rows]

    def max_verify_tokens(self, model: CausalLM, caches: ModelCaches) -> int | None:
        """MAX_VERIFY_TOKENS where the model's verify steps replay a captured graph (capturing the smallest one
        over `caches` to find out); None where they run the module path (e.g. a KDA hybrid, or Qwen3-Next's
        GDN layout, which the graphs do not capture), whose cost does not jump past any token count."""
        return MAX_VERIFY_TOKENS if self.verify_graph(model, caches, 2) is not None else None

    def verify_graph(self, model: CausalLM, caches: ModelCaches, tokens: int) -> VerifyGraph | None:
        """The verify graph of `tokens` tokens over `caches`, captured the first time a verify step of that many
        tokens runs over them (None: not capturable, as the decode graphs are not)."""
        if self.decode_graph(model, caches, 1) is None:  # binds the graphs to (model, caches); same parts
            return None
        if tokens not in self._verify_graphs:
            try:
                self._verify_graphs[tokens] = VerifyGraph(model, caches, tokens)
            except GraphUnsupportedError as e:
                logger.info("verify graph not captured for %d tokens, the module path runs: %s", tokens, e)
                self._verify_graphs[tokens] = None
        return self._verify_graphs[tokens]


def _move_weights_to_huge_pages(model: CausalLM, parts: list[nn.Module]) -> bool:
    """Every parameter of HUGE_PAGE_MIN_BYTES or more, and the linear layers' packed copies, into one huge-page
    mapping; False where there is nothing to move or the platform cannot. A released weight is no parameter any
    more (its layer's copy in `impl.tensors()` moves instead); oneDNN's opaque packed copies stay where they are."""
    params = [p for p in model.parameters() if p.nbytes >= HUGE_PAGE_MIN_BYTES and p.is_contiguous()]
    impls = [m.impl for m in parts if isinstance(m, Linear) and m.impl.tensors()]
    olds = [p.data for p in params] + [t for impl in impls for t in impl.tensors()]
    news = huge_page_zeros([(tuple(t.shape), t.dtype) for t in olds], fault_in=False)
    del olds
    if news is None:
        return False
    # one tensor at a time, each old copy freed as its new one is in place (the mapping's pages are faulted in
    # by the copies, not up front): the peak is the model plus its largest tensor, not twice the model
    for p, t in zip(params, news):
        p.data = t.copy_(p.data)
        return_free_heap()  # the old copy, back to the OS (glibc would keep it in its heap)
    rest = iter(news[len(params) :])
    for impl in impls:
        impl.rebind([next(rest).copy_(t) for t in impl.tensors()])
        return_free_heap()
    return True
