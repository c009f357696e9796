"""recap.server.process_memory: the process's memory split, and the trimmer that gives free heap back."""

from __future__ import annotations

import asyncio

import pytest

from recap.server import process_memory
from recap.server.process_memory import MallocTrimmer

glibc = pytest.mark.skipif(process_memory._LIBC is None, reason="mallinfo2/malloc_trim are glibc's")


def _fragment_heap() -> bytes:
    """~64 MiB of 1 KiB chunks (malloc's, not pymalloc's) freed below a live one: free heap malloc keeps."""
    chunks = [bytes(1024) for _ in range(64 * 1024)]
    pin = bytes(1024)  # allocated last: the freed chunks sit below it, so free() alone cannot shrink the heap
    del chunks
    return pin


@glibc
def test_snapshot_splits_resident_memory() -> None:
    snap = process_memory.snapshot()
    assert snap["rss_bytes"] > 0 and snap["python_blocks"] > 0 and snap["gc_objects"] > 0
    assert snap["malloc_in_use_bytes"] > 0 and snap["malloc_free_bytes"] is not None
    assert process_memory.snapshot(count_gc_objects=False)["gc_objects"] is None


@glibc
def test_the_trimmer_gives_free_heap_back_only_when_enough_is_free() -> None:
    pin = _fragment_heap()
    free = process_memory.snapshot(False)["malloc_free_bytes"]
    assert free is not None and free > 32 << 20
    assert not MallocTrimmer(1.0, min_free_bytes=free * 2).trim_if_worth_it()
    trimmer = MallocTrimmer(1.0, min_free_bytes=16 << 20)
    rss = process_memory.rss_bytes()
    assert trimmer.trim_if_worth_it() and trimmer.num_trims == 1
    assert process_memory.rss_bytes() < rss - (16 << 20)
    assert not trimmer.trim_if_worth_it()  # nothing left worth a trim
    del pin


@glibc
def test_the_trimmer_runs_on_its_interval() -> None:
    trimmer = MallocTrimmer(0.01, min_free_bytes=16 << 20)

    async def run() -> None:
        task = asyncio.create_task(trimmer.run())
        pin = _fragment_heap()
        for _ in range(500):
            if trimmer.num_trims:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        del pin

    asyncio.run(run())
    assert trimmer.num_trims >= 1
    with pytest.raises(ValueError):
        MallocTrimmer(0)
