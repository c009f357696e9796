"""retain_freed_memory: glibc accepts both thresholds (in a child process: the setting is process-wide).

The effect on page faults is measured in docs/performance.md (a 1,800-token prefill: ~430k minor faults
-> ~0); a page-fault count of single large buffers was not stable enough for a unit test (glibc may
split a freed chunk for small allocations in between).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = "from recap.process.heap import retain_freed_memory; print(retain_freed_memory())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_glibc_accepts_the_thresholds() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "True"
