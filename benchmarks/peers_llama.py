"""llama.cpp for the peers benchmark: built from the llama-cpp-python sdist, GGUF conversion, its tools.

The build is cached under --build-dir (default build/peers, git-ignored): the sdist is fetched with
`pip download --no-deps --no-binary :all:`, cmake configures its vendor/llama.cpp through the resolved path
(a symlinked source path makes ninja loop), with -DGGML_NATIVE=ON, at nice 19 (a shared machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-server", "llama-batched-bench")


@dataclass(frozen=True)
class LlamaCpp:
    src: Path  # vendor/llama.cpp (resolved)
    bin: Path  # the build's bin/

    def tool(self, name: str) -> Path:
        return self.bin / name


def _run(cmd: list[str], log: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    out = open(log, "a") if log is not None else None  # noqa: SIM115 (closed below)
    try:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT if out else None, env=env, cwd=cwd)
    finally:
        if out is not None:
            out.close()


def ensure_llama(build_dir: Path, targets: tuple[str, ...] = TARGETS) -> LlamaCpp:
    """The cached build of `targets`, or fetch + configure + build them (tens of minutes on 2 cores)."""
    build_dir = build_dir.resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    version = LLAMA_CPP_PYTHON.split("==")[1]
    root = build_dir / f"llama_cpp_python-{version}"
    if not root.is_dir():
        sdist = build_dir / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                  "-d", str(build_dir)])  # fmt: skip
        with tarfile.open(sdist) as tar:
            tar.extractall(build_dir, filter="data")
    src = (root / "vendor" / "llama.cpp").resolve()
    out = build_dir / "llama-build"
    bin_dir = out / "bin"
    if all((bin_dir / t).is_file() for t in targets):
        return LlamaCpp(src, bin_dir)
    log = build_dir / "build.log"
    print(f"building llama.cpp in {out} (log: {log}) ...", flush=True)
    if not (out / "build.ninja").is_file():
        _run(["nice", "-n", "19", "cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], log)  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    _run(["nice", "-n", "19", "cmake", "--build", str(out), "-j", jobs, "--target", *targets], log)
    return LlamaCpp(src, bin_dir)


def convert_to_gguf(llama: LlamaCpp, checkpoint: Path, outtype: str, out_dir: Path) -> Path:
    """checkpoint (HF folder without tokenizer files: llama.cpp uses its built-in GPT-NeoX vocabulary) -> GGUF."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{checkpoint.name}-{outtype}.gguf"
    if out.is_file():
        return out
    env = {**os.environ, "PYTHONPATH": str(llama.src / "gguf-py")}
    tmp = out.with_suffix(".tmp")
    _run([sys.executable, str(llama.src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", outtype,
          "--outfile", str(tmp)], out_dir / "convert.log", env=env, cwd=llama.src)  # fmt: skip
    tmp.rename(out)
    return out


def bench_json(llama: LlamaCpp, gguf: Path, threads: int, args: list[str]) -> list[dict]:
    """llama-bench -o json with `args` (e.g. ["-p", "2048", "-n", "0"])."""
    cmd = [str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def prefill_tok_s(llama: LlamaCpp, gguf: Path, threads: int, n: int) -> float:
    return float(bench_json(llama, gguf, threads, ["-p", str(n), "-n", "0", "-b", str(n), "-ub", "512"])[0]["avg_ts"])


def decode_ms(llama: LlamaCpp, gguf: Path, threads: int, steps: int, depth: int) -> float:
    """ms per generated token at batch 1, after `depth` tokens of context."""
    rows = bench_json(llama, gguf, threads, ["-p", "0", "-n", str(steps), "-d", str(depth)])
    return 1e3 / float(rows[0]["avg_ts"])


def batched_tok_s(llama: LlamaCpp, gguf: Path, threads: int, batch: int, prompt: int, steps: int) -> float:
    """Aggregate generated tokens/s of `batch` parallel sequences (llama-batched-bench, S_TG)."""
    ctx = batch * (prompt + steps) + 64
    cmd = [str(llama.tool("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-c", str(ctx),
           "-npp", str(prompt), "-ntg", str(steps), "-npl", str(batch), "--output-format", "jsonl"]  # fmt: skip
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


def server_cmd(llama: LlamaCpp, gguf: Path, threads: int, port: int, ctx: int) -> list[str]:
    """llama-server with one slot (the multi-turn and shared-prompt measures are one conversation at a time)."""
    return [str(llama.tool("llama-server")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "--port", str(port), "--host", "127.0.0.1", "-c", str(ctx), "-np", "1", "--no-webui"]  # fmt: skip
