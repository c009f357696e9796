"""Async scheduling's placeholders: a scheduled-ahead row's last input id is the token the step before sampled.

The scheduler sends such a row before that step's update (core/async_scheduling.py) with PLACEHOLDER_TOKEN_ID in
its place. The runner keeps each step's sampled ids as a tensor where the model runs and, before the next forward,
gathers them into the batch's input ids: `input_ids[flat[r]] = prev_ids[prev_row[r]]`, one indexed copy with no
read on the host. `fill_ref` is the plain reference: the same ids from the host's dict of the step's samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from recap.core.output import ScheduledRequest


class SampledIds:
    """The last step's sampled ids, in one tensor on the model's device, and the row of each request in it.
    `ids` is the step's own tensor (backends' forward_greedy): the fill reads it on the device, ordered after the
    step that wrote it by the stream, before the step's output is resolved on the host."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.rows: dict[str, int] = {}

    def keep(self, request_ids: Sequence[str], ids: torch.Tensor, device: torch.device) -> None:
        """Keep a step's sampled ids (one per request in `request_ids`, the greedy head's own tensor where the model
        ran it; the sampler's are on the host) for the step scheduled after it: no read on the host."""
        self.rows = {rid: i for i, rid in enumerate(request_ids)}
        self.ids = ids.to(device, non_blocking=True)

    def fill(self, rows: Sequence[ScheduledRequest], input_ids: torch.Tensor) -> None:
        """Write each placeholder row's token into `input_ids` (the flat ids of these rows, padding after them)."""
        flat, src = _placeholders(rows, self.rows)
        if not flat:
            return
        assert self.ids is not None
        index = torch.tensor([flat, src], dtype=torch.int64).to(input_ids.device, non_blocking=True)  # one copy
        input_ids[index[0]] = self.ids[index[1]]


def fill_ref(rows: Sequence[ScheduledRequest], sampled: Mapping[str, int]) -> list[list[int]]:
    """Each row's token ids with its placeholder replaced by the request's sampled token (the reference)."""
    return [[*s.token_ids[:-1], sampled[s.request_id]] if s.placeholder else list(s.token_ids) for s in rows]


def _placeholders(rows: Sequence[ScheduledRequest], prev_rows: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """(flat index in the batch, row in the last step's ids) of every placeholder."""
    flat: list[int] = []
    src: list[int] = []
    end = 0
    for s in rows:
        end += len(s.token_ids)
        if s.placeholder:
            row = prev_rows.get(s.request_id)
            if row is None:
                raise RuntimeError(f"{s.request_id}: a placeholder row, but the step before sampled nothing for it")
            flat.append(end - 1)
            src.append(row)
    return flat, src
