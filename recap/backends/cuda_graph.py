"""A decode step of a fixed shape captured as a CUDA graph: the GPU's decode fast path (vLLM's CUDA graphs).

At batch 1 a decode step of a 1B hybrid on an H100 spent ~98% of its time launching kernels from Python (20.9
tok/s, 1.5% of the weight-streaming bound): the card waited for the host. A graph records every kernel launch
of a step once and replays them with one call. Its launches read fixed addresses, so a captured step owns its
inputs: one int64 buffer laid out as kernels/batch.py packs a ForwardBatch (`packed`), whose views are the
metadata tensors of the batch the graph was captured over. A step of the same shape (the same rows, block-table
width and metadata layout: `shape_key`) is replayed by copying its packed buffer into the graph's (one copy)
and replaying. Shapes are few: the CUDA backend pads a decode step's rows to a captured row count with padding
rows (PAD_SLOT_ID everywhere, so kernels read and write no slot for them) and its block tables to a power-of-two
width (backends/cuda.py).

What a graph cannot do is read the host: the layers' host-list decisions are frozen at capture, so the graph
is captured over padding rows only, where they take the general path (padding masks recorded, no checkpoint
copy), and the kernels decide per row from the device tensors. The checkpoints a step plans (a row whose token
completes a block) are copied after the replay from the rows' running slots, every layer's state at once, as the
CPU decode graph does (backends/decode_graph.py), and their positions checked (provenance).

A step may also take its output head and each row's argmax inside the capture (`head`: the model's greedy_tokens),
for steps whose sampled rows all take the argmax of their raw logits: the replay then yields the rows' token ids,
and one copy of them (8 bytes a row) is what reaches the host, not the logits; the head runs on the card while the
host waits for nothing but that copy (backends/cuda.py keeps a graph per shape with and without it).

`Capture` makes a replay from a step: `cuda_graph_capture` on a GPU, `rerun_capture` (the reference: the same
step over the same static inputs, run eagerly) where there is no GPU (the tests, under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recap.kernels.batch import batch_on, pack_batch, packed_fields
from recap.kernels.metadata import PAD_SLOT_ID, ForwardBatch
from recap.model.cache import ModelCaches

# What a captured step yields: its hidden states [rows, D] and, where it takes the head, each row's argmax [rows]
StepOutput = tuple[torch.Tensor, torch.Tensor | None]
Step = Callable[[], StepOutput]  # one decode step over the graph's static inputs
Replay = Callable[[], StepOutput]  # run the captured step again -> its outputs (the graph's own buffers)
Capture = Callable[[Step], Replay]
Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [rows, D] -> token ids [rows] (CausalLM.greedy_tokens)


class HostReadError(RuntimeError):
    """The step reads a device tensor's value on the host: it cannot be captured, for any shape."""


def shape_key(batch: ForwardBatch) -> tuple[tuple[int, ...], ...]:
    """The shapes of the batch's packed metadata tensors but the last (logits_indices): steps with equal keys
    have the same packed layout, so one graph replays them all."""
    return tuple(tuple(getattr(o, n).shape) for o, n in packed_fields(batch)[:-1])


_INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)


class HostReads(TorchDispatchMode):
    """Raises HostReadError at an op whose result needs a tensor's value on the host (.item(), nonzero, unique,
    bincount, a boolean mask's index): the ops a GPU runs with a sync, which a CUDA graph cannot record. On a CPU
    (the reference capture) they cost nothing, so they are caught by what they are, not by a sync."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        tags = func.tags
        data_dependent = torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
        if data_dependent and func in _INDEX_OPS:  # integer indices have a fixed shape; boolean masks do not
            data_dependent = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if data_dependent:
            raise HostReadError(f"{func} reads a tensor's value on the host")
        return func(*args, **(kwargs or {}))


def rerun_capture(step: Step) -> Replay:
    """The reference capture: each replay runs the step again, eagerly, over the same static inputs. Its
    warm-up run (as a capture runs it once) fails with HostReadError where the step reads the host (HostReads),
    as cuda_graph_capture's warm-up does on a GPU."""
    with HostReads():
        step()
    return step


def cuda_graph_capture(pool: object | None = None, warmup: int = 2) -> Capture:
    """Capture on the current CUDA device: `warmup` eager runs on a side stream (Triton compiles its kernels
    there, torch's allocator settles), then the recorded step; graphs captured with one `pool` share memory
    (they never run at once). The warm-up runs with torch's sync debug mode at "error": a step that reads the
    device from the host (a MoE's per-expert loop) fails there with HostReadError, before a capture is begun
    (a capture that fails midway can leave the caching allocator's pool unusable)."""

    def capture(step: Step) -> Replay:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):
                torch.cuda.set_sync_debug_mode("error")
                for _ in range(warmup):
                    step()
        except RuntimeError as e:
            raise HostReadError(str(e)) from e
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # the engine's other threads
            out = step()

        def replay() -> StepOutput:
            graph.replay()
            return out

        return replay

    return capture


def static_input_bytes(template: ForwardBatch) -> int:
    """The bytes a CapturedStep over `template` holds for its static inputs (CapturedStep.static_bytes), from the
    template's metadata alone: every tensor packed as int64, and a one-byte copy of each bool one."""
    fields = [getattr(o, n) for o, n in packed_fields(template)]
    return sum(8 * t.numel() + (t.numel() if t.dtype == torch.bool else 0) for t in fields)


class CapturedStep:
    """One model's decode step of one shape over one cache set, captured (see the module docstring)."""

    def __init__(self, model: Callable[[ForwardBatch, ModelCaches], torch.Tensor], caches: ModelCaches,
                 template: ForwardBatch, capture: Capture, head: Head | None = None) -> None:  # fmt: skip
        """`template`: a batch of the shape to capture whose rows are all padding rows (it reads and writes no
        slot while it is captured), on the device the graph runs on; `head`: what the step also computes from its
        hidden states, every row's (None: the step ends at the hidden states)."""
        if template.ssm is not None and any(s != PAD_SLOT_ID for s in template.ssm.state_indices_list):
            raise ValueError("a decode graph is captured over padding rows only")
        self.key = shape_key(template)
        self.rows = template.num_seqs
        self._size = sum(getattr(o, n).numel() for o, n in packed_fields(template)[:-1])
        static = batch_on(template, pack_batch(template))
        assert static.packed is not None
        self._packed = static.packed
        # bool tensors are copies, not views, of the packed buffer: refreshed from it after each load
        self._bools = [(getattr(o, n), off) for o, n, off in self._bool_fields(static)]
        self.batch = static
        self._caches = caches
        self.takes_head = head is not None

        def step() -> StepOutput:
            hidden = model(static, caches)
            return hidden, None if head is None else head(hidden)

        self.replay = capture(step)

    @property
    def static_bytes(self) -> int:
        """The bytes of the step's static inputs this capture holds: the packed buffer and its bool copies."""
        return self._packed.nbytes + sum(t.nbytes for t, _ in self._bools)

    @staticmethod
    def _bool_fields(batch: ForwardBatch) -> list[tuple[object, str, int]]:
        out, off = [], 0
        for o, n in packed_fields(batch):
            t = getattr(o, n)
            if t.dtype == torch.bool:
                out.append((o, n, off))
            off += t.numel()
        return out

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> StepOutput:
        """The step's hidden states [rows, D] and, where it takes the head, every row's token id [rows] (the graph's
        buffers: read before the next replay); `caches` (the set it was captured over) are updated as the module
        path does, checkpoints included. The caller found this graph by the batch's shape_key
        (CudaBackend.captured), so the shape is not checked again per step."""
        assert caches is self._caches and batch.num_seqs == self.rows, "a decode graph runs steps of its shape"
        packed = batch.packed if batch.packed is not None else pack_batch(batch)
        self._packed[: self._size].copy_(packed[: self._size], non_blocking=True)
        for t, off in self._bools:
            t.copy_(self._packed[off : off + t.numel()].view(t.shape), non_blocking=True)
        outputs = self.replay()
        if batch.planned_checkpoints:  # a row's token completed a block: its new state, every layer's, is one
            assert batch.ssm is not None
            caches.copy_checkpoints((batch.ssm.state_indices_list[r], p, s) for r, p, s in batch.planned_checkpoints)
        return outputs
