"""The host tensors of a ForwardBatch (kernels/batch.py `_host`, built through array.array and torch.frombuffer) equal
torch.tensor's on the same lists: 1-D and 2-D, int64 and bool, pad ids, empty."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.batch import _host


@pytest.mark.parametrize(
    ("x", "dtype"),
    [
        ([5], torch.int64),
        ([3, -1, 2**40, 0], torch.int64),
        ([], torch.int64),
        ([[1, 2, -1], [4, -1, -1]], torch.int64),
        ([[7]], torch.int64),
        ([True, False, True], torch.bool),
        ([], torch.bool),
    ],
)
def test_host_equals_torch_tensor(x: list, dtype: torch.dtype) -> None:
    want = torch.tensor(x, dtype=dtype)
    got = _host(x, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu"
    assert torch.equal(got, want)
    if got.numel():
        got.add_(1) if dtype == torch.int64 else got.logical_not_()  # writable, and it owns its memory
        assert not torch.equal(got, want)


def test_ragged_rows_are_refused_as_torch_tensor_refuses_them() -> None:
    """[[1, 2], [3], [4, 5, 6]] holds 6 values: a view of 3 rows of 2 would pass silently without the check."""
    with pytest.raises(ValueError):
        torch.tensor([[1, 2], [3], [4, 5, 6]])
    with pytest.raises(ValueError, match="unequal lengths"):
        _host([[1, 2], [3], [4, 5, 6]])
