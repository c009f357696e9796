"""Helpers of the Triton conv/scan tests: packed rows, their metadata on the test device (the GPU where there
is one, else the CPU under the interpreter; tests/kernels/triton/conftest.py makes it the default device),
and the slots a step may write."""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SeqSpec, SSMMetadata, build_forward_batch

from ..cases import Row

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 on CPU (the interpreter runs numpy fp32) matches tightly; a GPU's exp/log differ in the last bits.
TOL = 2e-5 if DEVICE.type == "cpu" else 1e-4


def ssm_meta(rows: list[Row], chunk_size: int) -> SSMMetadata:
    """The SSM metadata of one packed step of `rows`, its tensors on DEVICE."""
    specs = [
        SeqSpec(
            token_ids=[0] * r.n,
            context_len=r.context_len,
            state_slot=PAD_SLOT_ID if r.padding else r.slot,
            checkpoints=r.checkpoints,
            padding=r.padding,
        )
        for r in rows
    ]
    # build_forward_batch makes its host tensors with the default device (the conftest's DEVICE): on a GPU
    # they would land there and pin_memory() would refuse them, so the host side is pinned to the CPU here.
    with torch.device("cpu"):
        fb = build_forward_batch(
            specs, block_size=16, chunk_size=chunk_size, with_attention=False, with_ssm=True, device=DEVICE
        )
    assert fb.ssm is not None
    return fb.ssm


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
