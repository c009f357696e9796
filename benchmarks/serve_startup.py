"""Start-up time of `recap serve` on the default model: process start to /health answering 200.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_startup.py [--warm 3] [--cold 1] [--threads 1] [MODEL]

cold: HOME points at a new empty folder, so recap's native kernels (cached under ~/.cache/recap/native,
recap/kernels/native.py) are compiled during the start, as on a first `make serve` on a new machine. The
operating system's page cache is not dropped (a shared machine): torch's and recap's files are already in
memory, so a start after a reboot pays their reads on top. warm: the same command again, the kernels cached.
Each start is stopped with SIGINT once it answers; the 1-minute load average is printed beside each start.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_s(model: str | None, port: int, threads: int, home: str | None, timeout_s: float = 600) -> float:
    """Seconds from launching `recap serve` to /health answering 200; the server is then stopped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)} | ({"HOME": home} if home else {})
    cmd = [sys.executable, "-m", "recap.cli", "serve", *([model] if model else []), "--port", str(port),
           "--num-threads", str(threads), "--log-level", "warning"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"recap serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no /health answer in {timeout_s} s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="model folder (default: the trained default model)")
    ap.add_argument("--cold", type=int, default=1, help="starts with a fresh HOME (native kernels compiled)")
    ap.add_argument("--warm", type=int, default=3, help="starts after those, kernels cached")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=18573)
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="recap-cold-home-") as home:
        for i in range(args.cold):
            fresh = Path(home) / f"h{i}"
            fresh.mkdir()
            rows["cold"].append((start_s(args.model, args.port, args.threads, str(fresh)), os.getloadavg()[0]))
            print(f"cold {rows['cold'][-1][0]:.1f} s (load {rows['cold'][-1][1]:.1f})", flush=True)
    start_s(args.model, args.port, args.threads, None)  # the kernels into the real cache (not counted)
    for _ in range(args.warm):
        rows["warm"].append((start_s(args.model, args.port, args.threads, None), os.getloadavg()[0]))
        print(f"warm {rows['warm'][-1][0]:.1f} s (load {rows['warm'][-1][1]:.1f})", flush=True)
    for kind, vals in rows.items():
        if vals:
            print(f"{kind}: median {statistics.median(v for v, _ in vals):.1f} s over {len(vals)}: "
                  + ", ".join(f"{v:.1f}" for v, _ in vals) + "; load " + ", ".join(f"{ld:.1f}" for _, ld in vals))


if __name__ == "__main__":
    main()
