"""tests/xdist_schedule.py under a worker that dies: the run ends (xdist 3.8.0 alone hangs at its end), the test
it died on fails once, and the rest of that file and the other files still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[1]
OK = "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n"
# tests/conftest.py's hook without its imports (torch: seconds per worker start)
SCHEDULER = ("from tests.xdist_schedule import SharedFixtureFileScheduling\n\n\n"
             "def pytest_xdist_make_scheduler(config, log):\n    return SharedFixtureFileScheduling(config, log)\n")
CRASH = "import os\n\n\ndef test_crash():\n    os._exit(1)\n\n\n" + OK  # test_a and test_b run after it


def test_a_crashed_worker_neither_hangs_the_run_nor_reruns_its_test(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(SCHEDULER)
    (tmp_path / "test_crash.py").write_text(CRASH)
    for i in range(3):
        (tmp_path / f"test_ok_{i}.py").write_text(OK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadfile", "-p", "no:randomly",
                          "-p", "no:cacheprovider", "-o", "addopts=", "-q", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    tail = run.stdout[-2000:]
    assert "1 failed, 8 passed" in tail, tail
    assert "test_crash.py::test_crash" in tail and "crashed while running" in tail, tail
