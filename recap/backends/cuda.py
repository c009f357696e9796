"""The CUDA backend: the module path with the Triton kernels, decode steps replayed from CUDA graphs.

A decode step's rows are padded to the next of GRAPH_ROWS with padding rows and its block tables to a
power-of-two width (`shape_rows`, before the batch is built), so that a few captured shapes serve every decode
step; each shape is captured the first time a step of it runs (backends/cuda_graph.py) and replayed after.
Prefill, mixed and verify steps, steps with sliding-window paging and models a graph cannot capture (a layer
that reads the host mid-step, e.g. a MoE's per-expert loop where the fused experts do not serve its experts:
model/layers/moe.py) run the module path, as --enforce-eager runs every step (the torch backend, eager.py).

A decode step whose sampled rows all take the argmax of their raw logits (greedy, no logprobs, penalties, bans or
grammar: the runner decides, runner/model_runner.py) replays a graph of its shape that also takes the output head
and the argmax (`forward_greedy`): the rows' token ids stay on the device for the runner, which reads them on the host
when the step runs or, under async scheduling, when the engine applies it (runner/host_copy.py); nothing of the step
runs outside the graph. Any other decode step replays the graph without them and the runner samples from the logits.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from recap.backends.cuda_graph import (
    Capture,
    CapturedStep,
    HostReadError,
    cuda_graph_capture,
    shape_key,
    static_input_bytes,
)
from recap.backends.eager import TorchBackend
from recap.backends.graph_memory import StepLimits
from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import KernelSet, kernel_set
from recap.kernels.metadata import PAD_SLOT_ID, ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.footprint import prefill_activation_bytes, widest_linear
from recap.model.model_config import ModelConfig
from recap.model.models import CausalLM

logger = logging.getLogger(__name__)

# Decode row counts captured (vLLM's sizes up to 256): a step of r rows runs the graph of the next one up.
GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_TABLE_BLOCKS = 8  # block tables are padded to a power of two of at least this many entries
MAX_GRAPHS = 64  # graphs per model and cache set (row counts x table widths x head or not); beyond: module path


def table_width(blocks: int) -> int:
    """The block-table width a decode step of rows with at most `blocks` blocks is padded to."""
    return max(MIN_TABLE_BLOCKS, 1 << max(blocks - 1, 0).bit_length())


class CudaBackend(TorchBackend):
    """The torch backend's module path plus CUDA graphs for decode steps (see the module docstring).

    `capture`: how a step is captured (None: a CUDA graph, all graphs sharing one memory pool;
    cuda_graph.rerun_capture, the eager reference, where there is no GPU: the tests)."""

    name: ClassVar[str] = "cuda"

    def __init__(self, linear_backend: str = "torch", kernels: KernelSet | None = None,
                 head_backend: str | None = None, capture: Capture | None = None) -> None:  # fmt: skip
        super().__init__(linear_backend, kernels or kernel_set("triton", torch.device("cuda")), head_backend)
        self._capture = capture
        self._bound: tuple[weakref.ref[nn.Module], weakref.ref[ModelCaches]] | None = None
        # by (shape_key, whether the step takes the head and argmax)
        self._graphs: dict[tuple[tuple[tuple[int, ...], ...], bool], CapturedStep | None] = {}
        # Graphs off for the prepared model: a step read the host while warming up (HostReadError), or it has
        # sliding-window layers; its decode steps are then not padded either.
        self._uncapturable = False

    def _prepare(self, model: CausalLM) -> None:
        super()._prepare(model)
        self._bound, self._graphs = None, {}  # captured over the old weights' addresses
        self._uncapturable = False

    def graph_bytes(self, model: CausalLM, limits: StepLimits) -> int:
        """What the decode graphs may hold for `model` under `limits`, before any is captured (the basis:
        backends/graph_memory.py): the static inputs and outputs of the MAX_GRAPHS largest shapes `limits` allow,
        and the shared pool's activations at the largest row count. 0 with sliding-window layers (no graph)."""
        config = model.config
        if config.window_layers:
            return 0
        largest = next((r for r in GRAPH_ROWS if r >= limits.max_num_seqs), GRAPH_ROWS[-1])
        rows = [r for r in GRAPH_ROWS if r <= largest]
        widths = [1]
        if config.has_attention:
            top = table_width(-(-limits.max_model_len // limits.block_size))
            widths = [w for w in (MIN_TABLE_BLOCKS << i for i in range(top.bit_length())) if w <= top]
        inputs = static_input_model(config, limits.block_size, self.kernels)
        shapes = []
        for r in rows:
            for w in widths:
                held = inputs(r, w) + r * config.hidden_size * model.dtype.itemsize  # + the hidden states
                shapes += [held, held + 8 * r]  # without the head, and with it (+ the rows' ids)
        # the shared pool: a step's live activations at the largest row count, and the head's fp32 logits
        widest = widest_linear(model, config.vocab_size)
        pool = prefill_activation_bytes(rows[-1], widest) + rows[-1] * config.vocab_size * 4
        return sum(sorted(shapes, reverse=True)[:MAX_GRAPHS]) + pool

    def shape_rows(self, specs: Sequence[SeqSpec]) -> Sequence[SeqSpec]:
        """A decode step's rows (one token each) padded to the next captured row count with padding rows, and
        every row's block table to table_width; any other step's rows as they are."""
        if (self._uncapturable or not specs or len(specs) > GRAPH_ROWS[-1]
                or any(len(s.token_ids) != 1 for s in specs)):
            return specs  # fmt: skip
        rows = next(r for r in GRAPH_ROWS if r >= len(specs))
        width = table_width(max(len(s.block_ids) for s in specs))
        padded = [replace(s, block_ids=[*s.block_ids, *[PAD_SLOT_ID] * (width - len(s.block_ids))]) for s in specs]
        pad = SeqSpec([0], padding=True, block_ids=[PAD_SLOT_ID] * width)
        return padded + [pad] * (rows - len(specs))

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """A decode step of a captured shape is replayed; any other step runs the modules."""
        step = self.captured(model, batch, caches)
        return model(batch, caches) if step is None else step.run(batch, caches)[0]

    def forward_greedy(
        self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of a captured shape replays its graph with the head and argmax: the sampled rows' ids stay
        on the device, in a tensor of their own (the graph's output is overwritten by its next replay); any other
        step runs the reference (the module path, then the head and argmax)."""
        step = self.captured(model, batch, caches, head=True)
        if step is None:
            return super().forward_greedy(model, batch, caches)
        hidden, ids = step.run(batch, caches)
        assert ids is not None
        return hidden, sampled_rows(ids, batch.sample_rows)

    def captured(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches,
                 head: bool = False) -> CapturedStep | None:  # fmt: skip
        """The graph of this step's shape, with the head and argmax or without (captured now if it is new), or
        None: the module path runs."""
        attn = batch.attn
        if batch.window_attn is not None:  # sliding-window paging is not padded (shape_rows): no graph, no padding
            self._uncapturable = True
        if (self._uncapturable or batch.num_draft_tokens or batch.num_tokens != batch.num_seqs
                or batch.num_seqs not in GRAPH_ROWS
                or (attn is not None and attn.block_tables.shape[1] != table_width(attn.block_tables.shape[1]))):
            return None  # fmt: skip
        if not self.serves(model):
            raise RuntimeError(f"the {self.name} backend runs the model it prepared last; prepare this one again")
        if self._bound is None or self._bound[0]() is not model or self._bound[1]() is not caches:
            self._bound, self._graphs = (weakref.ref(model), weakref.ref(caches)), {}
        key = (shape_key(batch), head)
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                return None
            self._graphs[key] = self._capture_step(model, batch, caches, head)
        return self._graphs[key]

    def _capture_step(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches,
                      head: bool) -> CapturedStep | None:  # fmt: skip
        if self._capture is None:
            self._capture = cuda_graph_capture(torch.cuda.graph_pool_handle())
        if self._uncapturable:
            return None
        try:
            return CapturedStep(model, caches, padding_template(batch), self._capture,
                                model.greedy_tokens if head else None)  # fmt: skip
        except HostReadError as e:  # a part reads the host mid-step (a MoE's per-expert loop): no shape captures
            self._uncapturable = True
            logger.warning("decode graphs off for this model, every step runs the module path: %s", e)
        except Exception as e:  # noqa: BLE001 - this shape runs eagerly, the reason logged
            logger.warning("decode graph not captured for %d rows, the module path runs: %s", batch.num_seqs, e)
        return None


def sampled_rows(ids: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A copy of `ids`' entries at `rows`, where `ids` is: a slice when they lead the batch (a decode step's rows
    come first, its padding after them), else a gather whose index travels in one host-to-device copy."""
    n = len(rows)
    if list(rows) == list(range(n)):
        return ids[:n].to(torch.int64, copy=True)
    return ids[torch.tensor(list(rows), dtype=torch.int64).to(ids.device, non_blocking=True)].to(torch.int64)


def padding_template(batch: ForwardBatch) -> ForwardBatch:
    """A batch of `batch`'s shape whose rows are all padding rows, on its device: what a graph is captured over."""
    attn, ssm = batch.attn, batch.ssm
    return shape_template(batch.num_seqs, 1 if attn is None else attn.block_tables.shape[1],
                          1 if attn is None else attn.block_size, None if ssm is None else ssm.chunk_size,
                          attn is not None, batch.input_ids.device, batch.kernels)  # fmt: skip


def shape_template(rows: int, width: int, block_size: int, chunk_size: int | None, with_attention: bool,
                   device: torch.device | str, kernels: KernelSet | None) -> ForwardBatch:  # fmt: skip
    """`rows` padding rows with tables `width` wide (chunk_size None: no SSM metadata). Its first row's length is
    the table's whole width, so that kernels that size their work from the rows' lengths on the host (attention's
    key splits) size it for the longest row the shape can hold."""
    specs = [SeqSpec([0], context_len=width * block_size - 1 if r == 0 else 0, padding=True,
                     block_ids=[PAD_SLOT_ID] * width) for r in range(rows)]  # fmt: skip
    return build_forward_batch(specs, block_size=block_size, chunk_size=1 if chunk_size is None else chunk_size,
                               with_attention=with_attention, with_ssm=chunk_size is not None, device=device,
                               kernels=kernels)  # fmt: skip


def static_input_model(config: ModelConfig, block_size: int, kernels: KernelSet) -> Callable[[int, int], int]:
    """(rows, table width) -> the static input bytes of a graph of that shape (cuda_graph.static_input_bytes),
    from four small host templates: the packed metadata is a + b rows + c width + e rows * width, so they fix
    it for every shape without building the large ones."""
    chunk = config.ssm_chunk_size if config.has_ssm else None
    w0 = MIN_TABLE_BLOCKS if config.has_attention else 1

    def size(r: int, w: int) -> int:
        template = shape_template(r, w, block_size if config.has_attention else 1, chunk, config.has_attention,
                                  "cpu", kernels)  # fmt: skip
        return static_input_bytes(template)

    s11, s21, s12, s22 = size(1, w0), size(2, w0), size(1, 2 * w0), size(2, 2 * w0)
    e = (s22 - s21 - s12 + s11) // w0
    b, c = s21 - s11 - e * w0, (s12 - s11) // w0 - e
    a = s11 - b - c * w0 - e * w0
    return lambda r, w: a + b * r + c * w + e * r * w
