"""Start-up time of `recap serve` on the default model: process start to /health answering 200, and then the
first completion (16 tokens of a short prompt: what a first request waits for, native kernels bound and decode
graphs captured as it goes).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_startup.py [--warm 3] [--cold 1] [--threads 1] [MODEL]

cold: HOME points at a new empty folder, so recap's native kernels (cached under ~/.cache/recap/native,
recap/kernels/native.py) are compiled during the start, as on a first `make serve` on a new machine. The
operating system's page cache is not dropped (a shared machine): torch's and recap's files are already in
memory, so a start after a reboot pays their reads on top. warm: the same command again, the kernels cached.
Each start is stopped with SIGINT once the completion is back; the 1-minute load average is printed beside each
start. Where PYTHONDONTWRITEBYTECODE is set (as on the shared build machine), every start also compiles recap's
own sources, which a checkout that keeps its __pycache__ does once: the script says so.
"""

from __future__ import annotations

import argparse
import json
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


def _first_completion_s(port: int) -> float:
    """Seconds of one completion (the served model's name read from /v1/models first, not timed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The Congress of the United States", "max_tokens": 16,
                       "temperature": 0})  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        if not json.loads(r.read())["choices"][0]["text"]:
            raise RuntimeError("the first completion came back empty")
    return time.perf_counter() - t0


def start_s(model: str | None, port: int, threads: int, home: str | None,
            timeout_s: float = 600) -> tuple[float, float]:  # fmt: skip
    """(seconds from launching `recap serve` to /health answering 200, seconds of the first completion after
    that); the server is then stopped."""
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
                        return time.perf_counter() - t0, _first_completion_s(port)
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
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set: every start compiles recap's own sources", flush=True)
    rows: dict[str, list[tuple[float, float, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="recap-cold-home-") as home:
        for i in range(args.cold):
            fresh = Path(home) / f"h{i}"
            fresh.mkdir()
            rows["cold"].append((*start_s(args.model, args.port, args.threads, str(fresh)), os.getloadavg()[0]))
            _say("cold", rows["cold"][-1])
    start_s(args.model, args.port, args.threads, None)  # the kernels into the real cache (not counted)
    for _ in range(args.warm):
        rows["warm"].append((*start_s(args.model, args.port, args.threads, None), os.getloadavg()[0]))
        _say("warm", rows["warm"][-1])
    for kind, vals in rows.items():
        if vals:
            print(f"{kind}: median {statistics.median(v for v, _, _ in vals):.1f} s to /health over {len(vals)}: "
                  + ", ".join(f"{v:.1f}" for v, _, _ in vals) + "; first completion median "
                  + f"{statistics.median(c for _, c, _ in vals):.2f} s; load "
                  + ", ".join(f"{ld:.1f}" for _, _, ld in vals))


def _say(kind: str, row: tuple[float, float, float]) -> None:
    print(f"{kind} {row[0]:.1f} s to /health, first completion {row[1]:.2f} s (load {row[2]:.1f})", flush=True)


if __name__ == "__main__":
    main()
