"""`recap serve` as a user starts it: a subprocess on a free loopback port, ready once /health answers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recap_command() -> list[str]:
    script = Path(sys.executable).parent / "recap"  # what `make serve` runs, once the package is installed
    return [str(script)] if script.is_file() else [sys.executable, "-m", "recap.cli"]


@contextmanager
def recap_serve(args: list[str], cwd: Path, timeout_s: float = 120) -> Iterator[tuple[str, Path]]:
    """Yields (base url, log path) once the server is healthy; stops it with SIGINT and asserts exit code 0."""
    port, log_path = free_port(), cwd / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*recap_command(), "serve", *args, "--port", str(port), "--num-threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=cwd)  # fmt: skip
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield url, log_path
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    assert rc == 0, log_path.read_text()
