"""record_decode_positions (kernels/varlen.py) writes slot_positions without reading the device from the host (a
CUDA graph replays it): against the plain loop over rows, with padding rows anywhere, all-padding steps included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.output import PAD_SLOT_ID
from recap.kernels.varlen import record_decode_positions


def _reference(slot_positions: torch.Tensor, slots: list[int], positions: list[int]) -> torch.Tensor:
    out = slot_positions.clone()
    for s, p in zip(slots, positions):
        if s != PAD_SLOT_ID:
            out[s] = p + 1
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_equals_the_row_loop(data: st.DataObject) -> None:
    num_slots = data.draw(st.integers(1, 12))
    rows = data.draw(st.integers(1, 10))
    real = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=min(rows, num_slots), unique=True))
    pads = rows - len(real)
    order = data.draw(st.permutations(real + [PAD_SLOT_ID] * pads))
    positions = data.draw(st.lists(st.integers(0, 500), min_size=rows, max_size=rows))
    slot_positions = torch.tensor(data.draw(st.lists(st.integers(-1, 500), min_size=num_slots, max_size=num_slots)))
    want = _reference(slot_positions, order, positions)
    record_decode_positions(slot_positions, torch.tensor(order), torch.tensor(positions))
    assert torch.equal(slot_positions, want)


def test_an_all_padding_step_changes_nothing() -> None:
    slot_positions = torch.tensor([7, -1, 3])
    record_decode_positions(slot_positions, torch.tensor([PAD_SLOT_ID] * 4), torch.tensor([9, 9, 9, 9]))
    assert slot_positions.tolist() == [7, -1, 3]
