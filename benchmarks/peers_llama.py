"""llama.cpp for the peers benchmark: built from the llama-cpp-python sdist, GGUF conversion, its tools.

The build is cached under --build-dir (default build/peers, git-ignored): the sdist is fetched with
`pip download --no-deps --no-binary :all:`, cmake configures its vendor/llama.cpp through the resolved path
(a symlinked source path makes ninja loop), with -DGGML_NATIVE=ON, at nice 19 (a shared machine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-server", "llama-batched-bench", "llama-quantize")


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


def run_logged(cmd: list[str], log: Path, done: re.Pattern[str], env: dict[str, str] | None = None, tries: int = 3
               ) -> str:  # fmt: skip
    """A llama.cpp tool's output, written to `log` (a file: through a pipe the last lines went missing), once it
    holds `done`. Its logger writes from a thread, and under load the last lines were sometimes lost at exit into
    a file too: the tool runs again, up to `tries` times."""
    for _ in range(tries):
        with open(log, "w") as fh:
            subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT, env=env)
        text = log.read_text()
        if done.search(text):
            return text
    raise RuntimeError(f"{done.pattern!r} not in {Path(cmd[0]).name}'s output after {tries} runs ({log}):\n"
                       f"{text[-2000:]}")  # fmt: skip


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


# convert_hf_to_gguf.py with the vocabulary replaced: the real-size checkpoints carry a word-level tokenizer
# ("t0".."t{V-1}") that its BPE detection refuses, so each model class gets llama.cpp's built-in GPT-NeoX vocabulary
# padded with unused "[PADi]" tokens up to the checkpoint's vocab_size (the embedding's rows). And transformers 5
# writes GraniteMoeHybrid's layer_types as "full_attention"/"linear_attention" where the hub's config.json (and
# the converter) say "attention"/"mamba": without the mapping every layer converts as Mamba2 and fails to load.
# Qwen3.5's converter wants MTP layers unless told --no-mtp; the random text checkpoint has none.
_PADDED_VOCAB = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[0] = src  # _set_vocab_builtin reads models/ under sys.path[0]
sys.path.insert(1, src + "/gguf-py")
import gguf
from conversion import granite, lfm2, qwen

def set_vocab(self):
    n, w = self.hparams["vocab_size"], self.gguf_writer
    lst, typ = w.add_token_list, w.add_token_types
    w.add_token_list = lambda t: lst(list(t) + [f"[PAD{i}]".encode() for i in range(len(t), n)])
    w.add_token_types = lambda t: typ(list(t) + [gguf.TokenType.UNUSED] * (n - len(t)))
    self._set_vocab_builtin("gpt-neox", n)

def get_attn_layers(self):
    types = self.hparams.get("layer_types") or []
    return [i for i, t in enumerate(types) if t in ("attention", "full_attention")] or attn_layers(self)

attn_layers = granite.GraniteHybridModel.get_attn_layers
granite.GraniteHybridModel.get_attn_layers = get_attn_layers
granite.GraniteHybridModel.set_vocab = set_vocab
lfm2.LFM2Model.set_vocab = set_vocab
qwen.Qwen3_5TextModel.set_vocab = set_vocab
qwen.Qwen3_5TextModel.no_mtp = True  # as --no-mtp: the random checkpoint has no MTP head to export
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_supports(llama: LlamaCpp, checkpoint: Path) -> str | None:
    """None when the vendored convert_hf_to_gguf.py registers the checkpoint's architecture, else why not (a
    text match on its quoted name, in the script or in the conversion/ package's name map of newer trees)."""
    arch = (json.loads((checkpoint / "config.json").read_text()).get("architectures") or [""])[0]
    sources = [llama.src / "convert_hf_to_gguf.py", llama.src / "conversion" / "__init__.py"]
    if any(f'"{arch}"' in f.read_text() for f in sources if f.is_file()):
        return None
    vendor = llama.src.parent.parent.name  # llama_cpp_python-<version>
    return f"{arch or 'a config without architectures'} is not in {vendor}'s convert_hf_to_gguf.py"


def convert_padded_vocab(llama: LlamaCpp, checkpoint: Path, out_dir: Path, quant: str) -> Path:
    """A real-size checkpoint -> GGUF bf16 (the padded built-in vocabulary above) -> `quant` via llama-quantize
    (Q4_0, Q4_K_M, Q8_0, ...); each file cached under out_dir."""
    out_dir = out_dir.resolve()  # the converter runs in llama.src
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / f"{checkpoint.name}-bf16.gguf"
    if not bf16.is_file():
        tmp = bf16.with_suffix(".tmp")
        _run([sys.executable, "-c", _PADDED_VOCAB, str(llama.src), str(checkpoint), "--outtype", "bf16",
              "--outfile", str(tmp)], out_dir / "convert.log", cwd=llama.src)  # fmt: skip
        tmp.rename(bf16)
    if quant.lower() == "bf16":
        return bf16
    out = out_dir / f"{checkpoint.name}-{quant}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        _run(["nice", "-n", "19", str(llama.tool("llama-quantize")), str(bf16), str(tmp), quant, "2"],
             out_dir / "quantize.log")  # fmt: skip
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
