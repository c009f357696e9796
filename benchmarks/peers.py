"""recap against llama.cpp on the same random checkpoints: one table, one command (run on request only).

    .venv/bin/python benchmarks/peers.py [--threads 1 2] [--models mamba2-115m hybrid-163m] [--reps 3]
        [--out bench_out/peers.json] [--recap-only] [--decode-only] [--eager] [--build-dir DIR]
    .venv/bin/python benchmarks/peers.py --reprint bench_out/peers.json      # the table of an earlier run
    .venv/bin/python benchmarks/peers.py --models lfm2-1.2b granite-h-1b --build-dir /work/main/build/peers \
        --out bench_out/peers_real.json   # real ~1.2B shapes: int4/int8 vs Q4_K_M/Q4_0/Q8_0, peak RSS (peers_real.py)
        [--metrics prefill decode] [--quants Q4_K_M Q8_0]   # a subset of the real-shape rows
    (real shapes: benchmarks/real_shapes.py's SHAPES, e.g. qwen3_5-0.8b; one the vendored converter does not register
     gets recap's rows and a "llama.cpp skipped" line)

llama.cpp is built once from the llama-cpp-python 0.3.36 sdist into build/peers (benchmarks/peers_llama.py;
tens of minutes on 2 cores) and the checkpoints (benchmarks/checkpoints.py) are converted with its own
convert_hf_to_gguf.py to GGUF f32 and q8_0. Measures, recap and llama.cpp alternating within each round,
medians over --reps rounds, the 1-minute load average beside each figure:
- prefill: one 2048-token prompt, tokens/s (recap: the model step; llama.cpp: llama-bench) and through each
  server (recap serve / llama-server, a fresh prompt, max_tokens 1: the cold time to first token);
- decode, batch 1: ms/token after a 128-token prompt (llama-bench -d 128); int8 rows compare recap's int8
  weights with llama.cpp's q8_0;
- decode, batch 8: aggregate generated tokens/s (llama.cpp: llama-batched-bench, 8 parallel sequences);
- the server's cold prefill as a percentage of the model step's, the two measured back to back each round;
- multi-turn TTFT through the servers: each turn resends the conversation plus 40 new tokens;
- tokens re-processed on a shared 1,500-token system prompt followed by different 40-token questions
  (recap: prompt - cached tokens; llama-server: timings.prompt_n).
recap runs with its native decode kernels (recap/kernels/linear_rows.py) unless --eager.
--decode-only measures the three decode rows only (no prefill, no servers).
Each speed figure also gets the fraction of the machine's limit it reaches: measured GEMM peak for prefill
(2 x linear params FLOP per token), weight bytes / measured mat-vec bandwidth for decode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402
from peers_llama import TARGETS, LlamaCpp, batched_tok_s, convert_to_gguf, decode_ms, ensure_llama, prefill_tok_s  # noqa: E402
from peers_real import RECAP_FORMATS, measure_real, print_real  # noqa: E402
from peers_servers import (  # noqa: E402  # noqa: E402
    LlamaServer,
    RecapServer,
    cold_prefill_tok_s,
    multiturn_ttft_s,
    shared_prompt_reprocessed,
    tokenizer_for,
)
from profile_decode import PROMPT, decoder  # noqa: E402
from real_shapes import DEFAULT_CACHE as REAL_CACHE  # noqa: E402
from real_shapes import SHAPES as REAL_SHAPES  # noqa: E402

from recap.backends import prepare  # noqa: E402
from recap.backends.huge_pages import move_to_huge_pages  # noqa: E402
from recap.bench.timing import timings  # noqa: E402
from recap.kernels.linear_rows import linear_rows_available, linear_rows_f32  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.layers.linear import Linear  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step  # noqa: E402
from recap.process.heap import retain_freed_memory  # noqa: E402

PREFILL = 2048
BLOCK = 16
STEPS = 24  # decode steps per measurement (the first two are dropped)


def load1() -> float:
    return os.getloadavg()[0]


def machine_limits(threads: int) -> dict[str, float]:
    """GEMM peak (GFLOP/s, a 2048 x 768 x 3072 fp32 product via oneDNN) and the rate at which one pass reads
    512 MiB of weights (GB/s): the best of a plain sum and of recap's one-row kernel over memory on huge pages
    (from 4 KiB pages both read slower, and llama.cpp exceeded that rate)."""
    torch.set_num_threads(threads)
    x, w = torch.randn(2048, 768), torch.randn(3072, 768)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    moved = move_to_huge_pages([torch.randn(32768, 4096) * 0.01])  # 512 MiB
    big = moved[0] if moved is not None else torch.randn(32768, 4096) * 0.01
    v = torch.randn(1, 4096)

    def best(f: Callable[[], Any], n: int) -> float:
        return min(timings(f, n, clock=time.perf_counter))

    gemm = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 10)
    reads = [best(big.sum, 10)]
    if linear_rows_available():
        reads.append(best(lambda: linear_rows_f32(v, big, None), 10))
    return {"gemm_gflops": 2 * 2048 * 768 * 3072 / gemm / 1e9, "matvec_gbs": big.nbytes / min(reads) / 1e9}


def weight_stats(path: Path, quant: str | None) -> dict[str, float]:
    """Linear parameters (FLOP per token = 2x) and the bytes a decode step reads for them."""
    lm = load_model(path, quantization=quant)
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    if lm.config.tie_word_embeddings:
        linears.append(lm.model.head())
    params = sum(m.weight.numel() for m in linears)
    return {"linear_params": params, "weight_bytes": params * (1 if quant else 4)}


class RecapModel:
    """recap's model step (no server): ForwardBatch build + forward + logits + greedy argmax."""

    def __init__(self, path: Path, quant: str | None, native_decode: bool) -> None:
        lm = load_model(path, quantization=quant, native_decode=native_decode)
        self.backend = prepare(lm)  # as the engine's runner does
        self.model = lm.model

    def prefill_tok_s(self) -> float:
        model = self.model
        ids = torch.randint(0, model.config.vocab_size, (PREFILL,), generator=torch.Generator().manual_seed(0))
        blocks = list(range(1, 1 + PREFILL // BLOCK))
        caches = ModelCaches.allocate(model.config, len(blocks) + 1, BLOCK, 2, model.dtype)
        t = time.perf_counter()
        hidden, batch = forward_step(model, caches, [SeqSpec(ids.tolist(), 0, blocks, state_slot=1)], self.backend)
        model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
        return PREFILL / (time.perf_counter() - t)

    def _step_s(self, batch: int) -> float:
        step = decoder(self.model, self.backend, batch, STEPS + 2)
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    def decode_ms(self) -> float:
        return 1e3 * self._step_s(1)

    def batch8_tok_s(self) -> float:
        return 8 / self._step_s(8)


def measure(name: str, threads: int, args: argparse.Namespace, llama: LlamaCpp | None) -> list[dict[str, Any]]:
    """Every metric, engines alternating within each round; one row per (metric, engine)."""
    torch.set_num_threads(threads)
    path = build_checkpoint(name, args.cache_dir / name)
    tok = tokenizer_for(path, args.build_dir / "tokenizers")
    f32 = RecapModel(path, None, not args.eager)
    int8 = RecapModel(path, "int8", not args.eager)
    ggufs = {}
    if llama is not None:
        ggufs = {q: convert_to_gguf(llama, path, q, args.build_dir / "gguf") for q in ("f32", "q8_0")}
    metrics: dict[tuple[str, str], Callable[[], float]] = {
        ("prefill tok/s", "recap"): f32.prefill_tok_s,
        ("decode ms b1", "recap"): f32.decode_ms,
        ("decode ms b1 int8", "recap"): int8.decode_ms,
        ("decode tok/s b8", "recap"): f32.batch8_tok_s,
    }
    if args.decode_only:
        del metrics[("prefill tok/s", "recap")]
    if llama is not None:
        g, q8 = ggufs["f32"], ggufs["q8_0"]
        metrics |= {
            ("prefill tok/s", "llama.cpp"): lambda: prefill_tok_s(llama, g, threads, PREFILL),
            ("decode ms b1", "llama.cpp"): lambda: decode_ms(llama, g, threads, STEPS, PROMPT),
            ("decode ms b1 int8", "llama.cpp"): lambda: decode_ms(llama, q8, threads, STEPS, PROMPT),
            ("decode tok/s b8", "llama.cpp"): lambda: batched_tok_s(llama, g, threads, 8, PROMPT, STEPS),
        }
        if args.decode_only:
            del metrics[("prefill tok/s", "llama.cpp")]
    order = [m for m, _ in metrics]  # each metric's engines back to back within a round
    metrics = dict(sorted(metrics.items(), key=lambda kv: order.index(kv[0][0])))
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.reps):
        for key, fn in metrics.items():
            samples.setdefault(key, []).append((fn(), load1()))
    if args.decode_only:
        return rows_of(name, threads, samples)
    servers = [RecapServer(path, tok, threads, args.port)]
    if llama is not None:
        servers.append(LlamaServer(llama, ggufs["f32"], threads, args.port + 1))
    vocab = f32.model.config.vocab_size
    for s in servers:
        s.start()
    try:
        for r in range(args.reps):
            for s in servers:
                cold = cold_prefill_tok_s(s, vocab, PREFILL, seed=1000 * r + 7)
                samples.setdefault(("server prefill tok/s", s.name), []).append((cold, load1()))
                if s.name == "recap":  # the model step right after it: the server's cost, side by side
                    samples.setdefault(("server/step prefill %", s.name), []).append(
                        (100 * cold / f32.prefill_tok_s(), load1()))
                samples.setdefault(("multi-turn TTFT ms", s.name), []).append(
                    (1e3 * multiturn_ttft_s(s, vocab, seed=1000 * r + 11), load1()))
                samples.setdefault(("re-processed tokens", s.name), []).append(
                    (shared_prompt_reprocessed(s, vocab, seed=1000 * r + 13), load1()))  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    return rows_of(name, threads, samples)


def rows_of(name: str, threads: int, samples: dict[tuple[str, str], list[tuple[float, float]]]) -> list[dict[str, Any]]:
    rows = []
    for (metric, engine), vals in samples.items():
        rows.append({"model": name, "threads": threads, "metric": metric, "engine": engine,
                     "median": statistics.median(v for v, _ in vals), "values": [v for v, _ in vals],
                     "load_1min": [round(ld, 2) for _, ld in vals]})  # fmt: skip
    return rows


def add_fractions(rows: list[dict[str, Any]], limits: dict[int, dict[str, float]], stats: dict[str, dict]) -> None:
    """Fraction of the machine's limit: prefill FLOP/s over GEMM peak, decode weight bytes/s over bandwidth."""
    for r in rows:
        lim, st = limits[r["threads"]], stats[r["model"]]
        m, v = r["metric"], r["median"]
        if m.endswith("prefill tok/s"):
            r["of_limit"] = 2 * st["linear_params"] * v / 1e9 / lim["gemm_gflops"]
        elif m.startswith("decode ms"):
            nbytes = st["weight_bytes_int8"] if "int8" in m else st["weight_bytes"]
            r["of_limit"] = nbytes / (v / 1e3) / 1e9 / lim["matvec_gbs"]
        elif m == "decode tok/s b8":
            r["of_limit"] = st["weight_bytes"] / (8 / v) / 1e9 / lim["matvec_gbs"]


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':<12} {'thr':>3} {'metric':<22} {'recap':>10} {'llama.cpp':>10} {'ratio':>6}  "
            f"{'of limit r/l':>13}  load")  # fmt: skip
    print(head)
    print("-" * len(head))
    keyed = {(r["model"], r["threads"], r["metric"], r["engine"]): r for r in rows}
    seen = []
    for r in rows:
        k = (r["model"], r["threads"], r["metric"])
        if k in seen:
            continue
        seen.append(k)
        a, b = keyed.get((*k, "recap")), keyed.get((*k, "llama.cpp"))
        lower_better = "ms" in r["metric"] or "tokens" in r["metric"]
        ratio = ""
        if a and b and a["median"] and b["median"]:
            ratio = f"{(b['median'] / a['median'] if lower_better else a['median'] / b['median']):.2f}x"
        frac = "/".join(f"{x['of_limit']:.0%}" if x and "of_limit" in x else "-" for x in (a, b))
        loads = ",".join(f"{ld:.1f}" for x in (a, b) if x for ld in x["load_1min"])
        print(f"{k[0]:<12} {k[1]:>3} {k[2]:<22} {a['median'] if a else float('nan'):>10.1f} "
              f"{b['median'] if b else float('nan'):>10.1f} {ratio:>6}  {frac:>13}  {loads}")  # fmt: skip
    print("ratio: how many times better recap is (>1: recap ahead); of limit: recap/llama.cpp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=["mamba2-115m", "hybrid-163m"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--build-dir", type=Path, default=Path("build") / "peers")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--recap-only", action="store_true", help="skip llama.cpp (no build, no GGUF)")
    ap.add_argument("--decode-only", action="store_true", help="the decode rows only (no prefill, no servers)")
    ap.add_argument("--eager", action="store_true", help="recap with torch's kernels only (no native decode kernels)")
    ap.add_argument("--metrics", nargs="+", choices=("prefill", "decode", "batch8"), default=None,
                    help="real shapes: measure only these (default: all three)")
    ap.add_argument("--quants", nargs="+", default=None,
                    help="real shapes: llama.cpp's GGUF types, each on every metric (e.g. Q4_K_M Q8_0)")
    ap.add_argument("--recap-formats", nargs="+", choices=tuple(RECAP_FORMATS), default=None,
                    help="real shapes: recap's formats (default: all; int4's output head is int8, int4+head4's int4)")
    ap.add_argument("--reprint", type=Path, help="print the table of an earlier run's JSON and exit")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "peers.json")
    args = ap.parse_args()
    if args.reprint is not None:
        data = json.loads(args.reprint.read_text())
        (print_real if data.get("real") else print_table)(data["rows"])
        return
    if set(args.models) & set(REAL_SHAPES):
        return main_real(args)
    retain_freed_memory()  # as `recap serve` does (recap/process/heap.py), so the model-step figures match it
    targets = ("llama-bench", "llama-batched-bench") if args.decode_only else TARGETS
    llama = None if args.recap_only else ensure_llama(args.build_dir, targets)
    limits = {t: machine_limits(t) for t in args.threads}
    print(f"machine limits (load {load1():.2f}): " + ", ".join(
        f"{t} thr: GEMM {v['gemm_gflops']:.0f} GFLOP/s, mat-vec {v['matvec_gbs']:.1f} GB/s" for t, v in limits.items()))
    stats = {}
    for name in args.models:
        path = build_checkpoint(name, args.cache_dir / name)
        stats[name] = weight_stats(path, None) | {"weight_bytes_int8": weight_stats(path, "int8")["weight_bytes"]}
    rows = []
    for name in args.models:
        for t in args.threads:
            rows += measure(name, t, args, llama)
    add_fractions(rows, limits, stats)
    print(f"\ntorch {torch.__version__}, fp32 unless 'int8' (recap int8 weights vs llama.cpp q8_0), medians of "
          f"{args.reps} alternating rounds, 1-min load average per sample")
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"limits": limits, "weights": stats, "rows": rows, "torch": torch.__version__},
                                   indent=1))  # fmt: skip
    print(f"wrote {args.out}")


def main_real(args: argparse.Namespace) -> None:
    """The real ~1.2B shapes (benchmarks/peers_real.py); other models cannot be mixed into this run."""
    if not set(args.models) <= set(REAL_SHAPES):
        raise SystemExit(f"real shapes {REAL_SHAPES} run on their own; drop {set(args.models) - set(REAL_SHAPES)}")
    retain_freed_memory()
    metrics = tuple(args.metrics or ("prefill", "decode", "batch8"))
    targets = ("llama-bench", "llama-quantize") + (("llama-batched-bench",) if "batch8" in metrics else ())
    llama = None if args.recap_only else ensure_llama(args.build_dir, targets)
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:  # the JSON after each model: a long run stopped half-way keeps what it measured
        rows += measure_real(name, args.threads, args.reps, llama, REAL_CACHE, args.build_dir / "gguf-real", metrics,
                             tuple(args.quants) if args.quants else None,
                             tuple(args.recap_formats) if args.recap_formats else None)  # fmt: skip
        args.out.write_text(json.dumps({"real": True, "start": start, "argv": sys.argv, "rows": rows}, indent=1))
    print(f"\n{start}, torch {torch.__version__}, medians of {args.reps} alternating rounds, 1-min load per sample")
    print_real(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
