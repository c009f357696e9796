"""Helpers of the Triton conv/scan tests: packed rows, their metadata on the test device (the GPU where there
is one, else the CPU under the interpreter; tests/kernels/triton/conftest.py makes it the default device),
and the slots a step may write."""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata

from ..cases import Row

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 on CPU (the interpreter runs numpy fp32) matches tightly; a GPU's exp/log differ in the last bits.
TOL = 2e-5 if DEVICE.type == "cpu" else 1e-4


def packed(rows: list[Row], key: str) -> torch.Tensor:
    """The per-token input `key` of every row, packed in row order."""
    return torch.cat([r.inputs[key] for r in rows])


def written_slots(meta: SSMMetadata) -> set[int]:
    """Running slots of valid rows and every checkpoint destination of the step."""
    running = {s for s in meta.state_indices_list if s != PAD_SLOT_ID}
    return running | {s for s in meta.chunk_dest_slots_list if s != PAD_SLOT_ID}


def assert_untouched(before: torch.Tensor, after: torch.Tensor, written: set[int]) -> None:
    """Every slot outside `written` is bit for bit what it was."""
    for slot in range(before.shape[0]):
        if slot not in written:
            assert torch.equal(before[slot], after[slot]), f"slot {slot} changed"
