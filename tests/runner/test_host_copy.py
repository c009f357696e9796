"""A step's deferred reads (runner/host_copy.py) against reading them at once, the GPU's calls (non-blocking copies
into host buffers, an event recorded after them and waited for on resolve) run on the CPU with a fake event and
unpinned buffers, the CUDA backend's sampled-row ids (a copy, never a view of the graph's output), and the
scheduler's refusal of an unresolved output. Pinned buffers and a real event run only where CUDA is."""

from __future__ import annotations

import pytest
import torch

from recap.backends.cuda import sampled_rows
from recap.core.output import CheckpointWrite, ModelRunnerOutput
from recap.runner.host_copy import CheckpointReads, HostCopy, PendingSamples, resolve_now
from tests.core.helpers import make_scheduler

torch.set_num_threads(1)


class FakeEvent:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def record(self) -> None:
        self.calls.append("record")

    def synchronize(self) -> None:
        self.calls.append("synchronize")


def test_host_copy_records_its_event_after_the_copies_and_waits_on_it() -> None:
    calls: list[str] = []
    ids, positions = torch.tensor([5, 7, 9]), torch.tensor([16, 32])
    copy = HostCopy([ids, positions], pinned=False, event=FakeEvent(calls))
    assert calls == ["record"]
    ids.fill_(0)  # the next step overwrites the step's own tensors (a graph's output, the slot positions)
    positions.fill_(-1)
    host = copy.wait()
    assert calls == ["record", "synchronize"]
    assert [t.tolist() for t in host] == [[5, 7, 9], [16, 32]]


def test_host_copy_on_the_cpu_needs_no_event() -> None:
    copy = HostCopy([torch.arange(4)])
    assert copy._event is None and copy.wait()[0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_pending_samples_resolve_as_the_reference_reads_them(with_checkpoints: bool) -> None:
    rids = ["a", "b", "c"]
    ids = torch.tensor([11, 22, 33])
    reads = CheckpointReads(["a", "c", "a"], [4, 6, 5]) if with_checkpoints else None
    positions = torch.tensor([16, 48, 32]) if with_checkpoints else None
    want = ModelRunnerOutput()
    resolve_now(want, rids, ids, reads, positions)
    calls: list[str] = []
    got = ModelRunnerOutput(pending=PendingSamples(rids, ids, reads, positions, pinned=False, event=FakeEvent(calls)))
    assert got.sampled_token_ids == {} and got.written_checkpoints == {}  # nothing read before resolve
    assert got.resolve() is got and got.pending is None and calls == ["record", "synchronize"]
    assert got.sampled_token_ids == want.sampled_token_ids == {"a": 11, "b": 22, "c": 33}
    assert got.written_checkpoints == want.written_checkpoints
    if with_checkpoints:
        assert got.written_checkpoints["a"] == [CheckpointWrite(16, 4), CheckpointWrite(32, 5)]
    got.resolve()  # a second resolve reads nothing again
    assert calls == ["record", "synchronize"]


def test_pending_samples_refuse_ids_that_do_not_match_the_rows() -> None:
    with pytest.raises(ValueError, match="2 sampled rows"):
        PendingSamples(["a", "b"], torch.tensor([1, 2, 3]), None, None)


def test_the_scheduler_refuses_an_unresolved_output() -> None:
    sched = make_scheduler()
    out = sched.schedule()
    pending = ModelRunnerOutput(pending=PendingSamples([], torch.empty(0, dtype=torch.int64), None, None))
    with pytest.raises(RuntimeError, match="not resolved"):
        sched.update_from_output(out, pending)
    sched.update_from_output(out, pending.resolve())


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], [1], []])
def test_cuda_sampled_rows_are_a_copy_of_the_graphs_ids(rows: list[int]) -> None:
    ids = torch.tensor([40, 41, 42, 43])  # a padded step's ids: the graph's static output
    got = sampled_rows(ids, rows)
    ids.fill_(0)  # its next replay
    assert got.dtype == torch.int64 and got.tolist() == [[40, 41, 42, 43][r] for r in rows]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and CUDA events need a GPU")
def test_host_copy_of_a_cuda_tensor_lands_in_pinned_memory() -> None:
    ids = torch.arange(32, device="cuda") * 3
    copy = HostCopy([ids])
    assert copy._event is not None
    (host,) = copy.wait()
    assert host.is_pinned() and host.tolist() == [3 * i for i in range(32)]
