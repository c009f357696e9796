"""retain_freed_memory: a large buffer freed and allocated again reuses heap pages (no fresh page faults).

Run in a child process: the setting is process-wide and has no getter, so the test needs a fresh process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import resource, torch
from recap.engine.heap import retain_freed_memory

def faults(nbytes):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # touch every page
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

size = 64 << 20  # 16384 pages, above glibc's default mmap threshold
default = faults(size)
ok = retain_freed_memory()
for _ in range(2):  # the first allocations after the change grow the heap
    faults(size)
print(default, ok, max(faults(size) for _ in range(3)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_memory_is_reused_without_page_faults() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout.split()
    default, ok, retained = int(out[0]), out[1] == "True", int(out[2])
    assert default > 8000  # glibc's default: a fresh mmap (and page faults) per large allocation
    assert ok and retained < 1000  # after retain_freed_memory: the freed pages are reused
