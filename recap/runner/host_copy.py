"""A step's reads from the model's device, started when it runs and waited for when the engine applies it.

Under async scheduling the runner returns before the step's sampled ids and checkpoint positions reach the host
(docs/gpu.md, async scheduling): `HostCopy` starts their copy into host buffers at once and `PendingSamples` (the
core's PendingReads) waits for it in `ModelRunnerOutput.resolve()`, after the next step was launched. On CUDA the
buffers are pinned, the copies non-blocking and an event marks their end; on the CPU the same calls copy at once and
there is no event. `resolve_now` is the plain reference: the same fields read with `.tolist()` when the step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from recap.core.output import CheckpointWrite, ModelRunnerOutput


class CopyEvent(Protocol):
    """What HostCopy needs of a torch.cuda.Event."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class HostCopy:
    """Device tensors on their way to host buffers. `pinned` and `event` default to what the tensors' device takes
    (pinned buffers and a CUDA event on a GPU, neither on the CPU); a test passes them to run the GPU's calls."""

    def __init__(self, tensors: Sequence[torch.Tensor], pinned: bool | None = None,
                 event: CopyEvent | None = None) -> None:  # fmt: skip
        cuda = any(t.device.type == "cuda" for t in tensors)
        pin = cuda if pinned is None else pinned
        # a host tensor's copy too: the step's own tensor (a graph's static output, the running slot positions)
        # changes once the next step runs
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin) for t in tensors]
        self._event = event if event is not None else torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()  # after the copies, on the stream that runs the step

    def wait(self) -> list[torch.Tensor]:
        """The host copies, once they are done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


@dataclass
class CheckpointReads:
    """The checkpoints a step planned (request id, slot per planned write) whose written positions are read."""

    request_ids: list[str]
    slots: list[int]


class PendingSamples:
    """A step's sampled ids (one per sampled row, in `request_ids`' order) and the positions its kernels wrote
    into its planned checkpoint slots, copying to the host; `resolve` fills the runner output's fields with them."""

    def __init__(self, request_ids: list[str], ids: torch.Tensor, checkpoints: CheckpointReads | None,
                 positions: torch.Tensor | None, pinned: bool | None = None,
                 event: CopyEvent | None = None) -> None:  # fmt: skip
        if ids.shape != (len(request_ids),):
            raise ValueError(f"{len(request_ids)} sampled rows, ids of shape {tuple(ids.shape)}")
        self.request_ids, self.checkpoints = request_ids, checkpoints
        self.copy = HostCopy([ids] if positions is None else [ids, positions], pinned, event)

    def resolve(self, result: ModelRunnerOutput) -> None:
        host = self.copy.wait()
        result.sampled_token_ids.update(zip(self.request_ids, host[0].tolist()))
        if self.checkpoints is not None:
            add_checkpoints(result, self.checkpoints, host[1].tolist())


def add_checkpoints(result: ModelRunnerOutput, reads: CheckpointReads, written: Sequence[int]) -> None:
    """Report what the kernels say they wrote (slot_positions), not what was planned."""
    for rid, slot, pos in zip(reads.request_ids, reads.slots, written):
        result.written_checkpoints.setdefault(rid, []).append(CheckpointWrite(position=int(pos), slot=slot))


def resolve_now(result: ModelRunnerOutput, request_ids: list[str], ids: torch.Tensor,
                checkpoints: CheckpointReads | None, positions: torch.Tensor | None) -> None:  # fmt: skip
    """The reference: the same fields read on the host when the step runs (the synchronous loop)."""
    result.sampled_token_ids.update(zip(request_ids, ids.tolist()))
    if checkpoints is not None and positions is not None:
        add_checkpoints(result, checkpoints, positions.tolist())
