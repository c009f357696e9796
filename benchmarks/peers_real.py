"""peers.py at real sizes: recap int4/int8 against llama.cpp Q4_K_M/Q4_0/Q8_0 on the ~1.2B shapes, peak RSS beside.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers.py --models lfm2-1.2b granite-h-1b --threads 1 2 --reps 3 \\
        --build-dir /work/main/build/peers --out bench_out/peers_real.json

The shapes are benchmarks/real_shapes.py's random bf16 checkpoints (granite-h-1b: GraniteMoeHybrid dense, 1.46B;
lfm2-1.2b: LFM2, 1.17B). llama.cpp gets them through convert_hf_to_gguf.py (bf16, its built-in GPT-NeoX vocabulary
padded to the checkpoint's size: peers_llama.convert_padded_vocab) and llama-quantize.

recap runs in one worker subprocess per format (RECAP_FORMATS: int4 with its int8 output head, int4_k, the
super-block int4, likewise, int4 head included, int8), loaded once per model and kept alive across rounds;
each request sets the thread count. Its peak RSS is the worker's VmHWM (the load included: recap
quantizes the bf16 checkpoint as it loads). llama.cpp's peak RSS is each tool run's ru_maxrss (os.wait4 of
the child; llama.cpp maps the GGUF, the mapped pages it touches count). recap's steady RSS (VmRSS between
requests) is printed beside its peak.
Metrics, recap and llama.cpp alternating within each round, medians over the rounds, the 1-minute load average
beside each sample: prefill tok/s of one REAL_PREFILL-token prompt (recap: the model step; llama-bench -p);
decode ms/token at batch 1 after a REAL_PROMPT-token prompt (llama-bench -d); batch-8 aggregate generated
tokens/s after REAL_PROMPT-token prompts (llama-batched-bench S_TG).
A shape whose architecture the vendored convert_hf_to_gguf.py does not register gets recap's rows only, and the
table a "llama.cpp skipped" line saying so.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_llama import LlamaCpp, convert_padded_vocab, converter_supports  # noqa: E402

REAL_PREFILL = 512
REAL_PROMPT = 64  # context before the decode rows (short: batched-bench prefills 8 x this at 1 thread)
REAL_STEPS = 16  # decode steps per measurement (recap drops the first two)
# recap's formats: name -> (quantization, head_quantization); "int4" is the default int4 (its output head at int8,
# model/head_format.py), "int4+head4" the head at int4 too
RECAP_FORMATS = {"int4": ("int4", "auto"), "int4_k": ("int4_k", "auto"), "int4+head4": ("int4", "same"),
                 "int8": ("int8", "auto")}
PREFILL_GGUF = ("Q4_K_M", "Q4_0")  # q8_0 on the decode row only (cheap there)
DECODE_GGUF = ("Q4_K_M", "Q4_0", "Q8_0")


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


# ---- recap's worker (runs in its own process) ---------------------------------------------------------------
def worker(path: Path, fmt: str) -> None:
    """Load once, then answer one JSON line per request line ("prefill|decode|batch8 THREADS")."""
    import profile_decode
    import torch

    from recap.backends import prepare
    from recap.kernels.metadata import SeqSpec
    from recap.model.cache import ModelCaches
    from recap.model.loader import load_model
    from recap.model.testing import forward_step
    from recap.process.heap import retain_freed_memory

    retain_freed_memory()  # as `recap serve` does
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    quant, head = RECAP_FORMATS[fmt]
    lm = load_model(path, quantization=quant, head_quantization=head)
    backend, model = prepare(lm), lm.model
    print(json.dumps({"load_s": time.perf_counter() - t0, **_status()}), flush=True)
    profile_decode.PROMPT = REAL_PROMPT

    def prefill() -> float:
        ids = torch.randint(0, model.config.vocab_size, (REAL_PREFILL,), generator=torch.Generator().manual_seed(0))
        blocks = list(range(1, 1 + REAL_PREFILL // 16))
        caches = ModelCaches.allocate(model.config, len(blocks) + 1, 16, 2, model.dtype)
        t = time.perf_counter()
        hidden, batch = forward_step(model, caches, [SeqSpec(ids.tolist(), 0, blocks, state_slot=1)], backend)
        model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
        return REAL_PREFILL / (time.perf_counter() - t)

    def step_s(batch: int) -> float:
        step = profile_decode.decoder(model, backend, batch, REAL_STEPS + 2)
        times = []
        for _ in range(REAL_STEPS):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    fns = {"prefill": prefill, "decode": lambda: 1e3 * step_s(1), "batch8": lambda: 8 / step_s(8)}
    for line in sys.stdin:
        what, threads = line.split()
        torch.set_num_threads(int(threads))
        print(json.dumps({"value": fns[what](), **_status()}), flush=True)


class RecapWorker:
    def __init__(self, path: Path, quant: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(path), quant], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.loaded = self._read()
        self.rss = self.loaded["VmRSS"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"recap worker exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, what: str, threads: int) -> tuple[float, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{what} {threads}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.rss = out["VmRSS"]  # steady: after the load's peak, between requests
        return out["value"], out["VmHWM"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- llama.cpp's tools, with the child's peak RSS -----------------------------------------------------------
def _run_rss(cmd: list[str]) -> tuple[str, int]:
    """stdout and ru_maxrss (bytes) of one tool run."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}")
    return out, usage.ru_maxrss * 1024


def llama_bench(llama: LlamaCpp, gguf: Path, threads: int, args: list[str]) -> tuple[float, int]:
    """avg tokens/s of llama-bench -r 1 with `args`, and its peak RSS."""
    out, rss = _run_rss([str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", "1",
                         "-o", "json", *args])  # fmt: skip
    return float(json.loads(out)[0]["avg_ts"]), rss


def llama_metric(llama: LlamaCpp, gguf: Path, what: str, threads: int) -> tuple[float, int]:
    if what == "prefill":
        return llama_bench(llama, gguf, threads, ["-p", str(REAL_PREFILL), "-n", "0", "-b", str(REAL_PREFILL)])
    if what == "decode":
        ts, rss = llama_bench(llama, gguf, threads, ["-p", "0", "-n", str(REAL_STEPS), "-d", str(REAL_PROMPT)])
        return 1e3 / ts, rss
    ctx = 8 * (REAL_PROMPT + REAL_STEPS) + 64
    out, rss = _run_rss([str(llama.tool("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-c",
                         str(ctx), "-npp", str(REAL_PROMPT), "-ntg", str(REAL_STEPS), "-npl", "8",
                         "--output-format", "jsonl"])  # fmt: skip
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"]), rss


# ---- the rounds ---------------------------------------------------------------------------------------------
METRICS = {"prefill": "prefill tok/s", "decode": "decode ms b1", "batch8": "decode tok/s b8"}


def _note(samples: dict, key: tuple[int, str, str], value_rss: tuple[float, int]) -> None:
    load = os.getloadavg()[0]
    samples.setdefault(key, []).append((*value_rss, load))
    print(f"  {key[0]} thr {key[1]:<8} {key[2]:<17} {value_rss[0]:9.1f}  RSS {value_rss[1] / 2**30:.2f} GiB  "
          f"load {load:.1f}", file=sys.stderr, flush=True)  # fmt: skip


def measure_real(name: str, threads_list: list[int], reps: int, llama: LlamaCpp | None, cache: Path,
                 gguf_dir: Path, metrics: tuple[str, ...] = tuple(METRICS),
                 quants: tuple[str, ...] | None = None, formats: tuple[str, ...] | None = None,
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """`metrics` for one shape at each thread count; engines alternate within each round (one runs at a
    time: recap's idle workers hold their memory but no CPU). `quants`: llama.cpp's formats, each on every
    metric (default: DECODE_GGUF on decode, PREFILL_GGUF on the others); `formats`: recap's (RECAP_FORMATS)."""
    from real_shapes import build_checkpoint

    path = build_checkpoint(name, cache)
    names = quants or DECODE_GGUF
    skipped = None if llama is None else converter_supports(llama, path)
    if skipped is not None:  # recap's rows only; the table says why llama.cpp has none
        print(f"{name}: llama.cpp skipped: {skipped}", file=sys.stderr, flush=True)
        llama = None
    ggufs = {} if llama is None else {q: convert_padded_vocab(llama, path, gguf_dir, q) for q in names}
    workers = {q: RecapWorker(path, q) for q in formats or RECAP_FORMATS}
    samples: dict[tuple[int, str, str], list[tuple[float, int, float]]] = {}
    try:
        for threads in threads_list:
            for _ in range(reps):
                for what in metrics:
                    for q, w in workers.items():
                        _note(samples, (threads, what, f"recap {q}"), w.ask(what, threads))
                    for q, g in ggufs.items():
                        if quants is None and what != "decode" and q not in PREFILL_GGUF:
                            continue
                        _note(samples, (threads, what, f"llama.cpp {q}"), llama_metric(llama, g, what, threads))  # type: ignore[arg-type]
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for (threads, what, engine), vals in samples.items():
        rows.append({"model": name, "threads": threads, "metric": METRICS[what], "engine": engine,
                     "median": statistics.median(v for v, _, _ in vals), "values": [v for v, _, _ in vals],
                     "peak_rss": max(r for _, r, _ in vals), "load_1min": [round(ld, 2) for _, _, ld in vals],
                     **_recap_extra(workers, engine)})  # fmt: skip
    if skipped is not None:
        rows.append({"model": name, "engine": "llama.cpp", "skipped": skipped})
    return rows


def _recap_extra(workers: dict[str, RecapWorker], engine: str) -> dict[str, Any]:
    if not engine.startswith("recap"):
        return {}
    w = workers[engine.split()[1]]
    return {"recap_load_s": w.loaded["load_s"], "steady_rss": w.rss}


def print_real(rows: list[dict[str, Any]]) -> None:
    """One line per (model, threads, metric, engine); ratios of recap int4 to llama.cpp Q4_K_M (>1: recap ahead)."""
    keyed = {(r["model"], r["threads"], r["metric"], r["engine"]): r for r in rows if "skipped" not in r}
    print(f"{'model':<13} {'thr':>3} {'metric':<16} {'engine':<17} {'median':>9} {'peak RSS GiB':>12} "
          f"{'steady':>6}  {'int4 vs Q4_K_M':>14}  load")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['model']:<13} llama.cpp skipped: {r['skipped']}")
            continue
        ratio = ""
        ref = keyed.get((r["model"], r["threads"], r["metric"], "llama.cpp Q4_K_M"))
        if r["engine"] == "recap int4" and ref:
            lower_better = "ms" in r["metric"]
            ratio = f"{(ref['median'] / r['median'] if lower_better else r['median'] / ref['median']):.2f}x"
        loads = ",".join(f"{ld:.1f}" for ld in r["load_1min"])
        steady = f"{r['steady_rss'] / 2**30:.2f}" if "steady_rss" in r else "-"
        print(f"{r['model']:<13} {r['threads']:>3} {r['metric']:<16} {r['engine']:<17} {r['median']:>9.1f} "
              f"{r['peak_rss'] / 2**30:>12.2f} {steady:>6}  {ratio:>14}  {loads}")  # fmt: skip


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    worker(Path(sys.argv[2]), sys.argv[3])
