"""The runner's side of a verify step: greedy acceptance and the slots that hold the state after each position."""

from __future__ import annotations

import random

import pytest

from recap.core.output import CheckpointWrite, ScheduledRequest
from recap.runner.speculative import accepted_length, greedy_emit, verify_rows


def test_greedy_emit_against_a_per_position_loop() -> None:
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(0, 6)
        drafts = [rng.randrange(3) for _ in range(k)]
        targets = [rng.randrange(3) for _ in range(k + 1)]
        emitted = []
        for j in range(k + 1):  # the plain way: emit the target's token; go on only while it equals the draft
            emitted.append(targets[j])
            if j == k or targets[j] != drafts[j]:
                break
        assert greedy_emit(drafts, targets) == emitted
        assert accepted_length(drafts, targets) == len(emitted) - 1
    with pytest.raises(ValueError, match="one more"):
        greedy_emit([1, 2], [1, 2])


def _row(rid: str, start: int, tokens: list[int], drafts: int, *checkpoints: CheckpointWrite) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, [], 7, list(checkpoints), num_draft_tokens=drafts)


def test_verify_rows_take_scratch_slots_and_reuse_a_planned_checkpoint() -> None:
    rows = [
        _row("plain", 3, [9], 0),
        _row("a", 15, [1, 2, 3, 4], 3, CheckpointWrite(16, 40)),  # the state after N = 16 is a checkpoint
        _row("b", 20, [5, 6], 1),
    ]
    got = verify_rows(rows, iter(range(100, 110)), with_state=True)
    assert [(v.row, v.request_id, v.first, v.drafts, v.state_slots) for v in got] == [
        (1, "a", 16, [2, 3, 4], [40, 100, 101]), (2, "b", 21, [6], [102])]
    assert got[0].extra_writes([(16, 40)]) == [(16, 40), (17, 100), (18, 101)]
    assert verify_rows(rows, iter(()), with_state=False)[0].state_slots == []
    with pytest.raises(RuntimeError, match="scratch"):
        verify_rows(rows, iter(range(100, 102)), with_state=True)
