"""Memory at real sizes: recap's RSS serving ~1.2B models in each weight format, against the weights' own size.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py [--quick] [--out bench_out/bench_memory.json]
    # the 7B-class shape in int4 (builds the 16 GB bf16 checkpoint on first use, then measures):
    PYTHONPATH=$PWD nice -n 10 .venv/bin/python benchmarks/bench_memory.py --shapes nemotron-h-8b --formats int4 \
        --decode-steps 32 --rss-ceiling 10737418240 --out bench_out/bench_memory_8b.json
    # another recap (e.g. main) measured by this harness: --recap-path /work/main

Models (benchmarks/real_shapes.py, random weights written once in bf16 into --cache-dir): granite-h-1b
(GraniteMoeHybrid dense shaped like granite-4.0-h-1b, 1.46B params) and lfm2-1.2b (LFM2-1.2B's shape, 1.17B);
on request granite-h-7b (6.66B) and nemotron-h-8b (Nemotron-H-8B-Base-8K's shape, 8.10B, untied vocab 131072).
Formats: fp32, bf16, int8 (int8 linear weights, the rest fp32: the CPU default dtype), int4 where recap offers it.

Each (model, format) runs in its own subprocess, one at a time: recap's LLM loads the model with modest pools
(--kv-cache-bytes, --state-cache-bytes), then decodes --decode-steps tokens after a 32-token prompt. Recorded:
the peak RSS while loading (VmHWM after the LLM is built), the steady RSS after decoding (VmRSS), recap's memory
plan (weights measured, the linear layers' copies, pools, overhead), and the weights' own size (one copy in the
serving format: recap.model.footprint's lower bound, from the config), and batch-1 decode ms/token (the tokens
after the prompt's first, from the request's own timestamps). The issue's targets: steady <= 1.15 x (own
weights + pools) + 0.5 GiB (`ratio` is steady / (own weights + pools)), and the load peak within the plan's
total + 10% (`load_within_plan`).

The parent watches each child's RSS and kills it past --rss-ceiling (default: MemAvailable at its start minus
--margin) or when the machine's MemAvailable falls under --floor: a format that does not fit is recorded as
such, not pushed into swap or the OOM killer. A child
whose plan recap refuses (MemoryPlanError) records the refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8"),
           "int4": ("float32", "int4")}  # fmt: skip
TARGET_FACTOR, TARGET_SLACK = 1.15, 0.5 * GIB


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


# ---- the child: one model in one format ---------------------------------------------------------------------
def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from recap import LLM, SamplingParams
    from recap.model.quant import QUANTIZATIONS

    dtype, quant = FORMATS[args.format]
    if quant is not None and quant not in QUANTIZATIONS:
        return {"unsupported": f"this recap offers {QUANTIZATIONS}"}
    start = _status()
    t0 = time.perf_counter()
    try:
        llm = LLM(args.child, dtype=dtype, quantization=quant, max_model_len=args.max_model_len, max_num_seqs=4,
                  kv_cache_bytes=args.kv_cache_bytes, state_cache_bytes=args.state_cache_bytes, num_threads=1)
    except Exception as e:  # noqa: BLE001 (MemoryPlanError where recap has it; main has no such type)
        if type(e).__name__ == "MemoryPlanError":
            return {"refused": str(e), "load_s": time.perf_counter() - t0}
        raise
    load_s = time.perf_counter() - t0
    loaded = _status()
    plan = llm.engine.runner.memory_plan()
    ids = torch.randint(10, llm.engine.model_config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True)
    t1 = time.perf_counter()
    (out,) = llm.generate([ids.tolist()], params)
    decode_s = time.perf_counter() - t1
    steady = _status()
    m, n = out.metrics, len(out.outputs[0].token_ids)
    # batch-1 decode: the tokens after the first (which the prompt's prefill produced)
    per_token = (m.finished_time - m.first_token_time) / (n - 1) if m and m.finished_time and n > 1 else None
    return {
        "start_rss": start.get("VmRSS", 0), "load_peak": loaded.get("VmHWM", 0), "loaded_rss": loaded.get("VmRSS", 0),
        "steady_rss": steady.get("VmRSS", 0), "peak": steady.get("VmHWM", 0), "load_s": load_s, "decode_s": decode_s,
        "decode_ms_per_token": None if per_token is None else 1e3 * per_token,
        "plan_weights": plan.weight_bytes, "plan_copies": plan.packed_bytes, "kv": plan.pools.kv_bytes,
        "state": plan.pools.state_bytes, "plan_overhead": getattr(plan, "overhead_bytes", None),
        "plan_total": getattr(plan, "total_bytes", None), "plan": plan.describe(),
    }  # fmt: skip


# ---- the parent ---------------------------------------------------------------------------------------------
def own_weight_bytes(folder: Path, fmt: str) -> int:
    """One copy of the weights in the serving format (this harness's recap: the plan's lower bound, the output
    head at its own format where this recap has one: int8 under int4)."""
    import torch

    from recap.model.footprint import serving_weight_bytes_lower_bound
    from recap.model.hf_config import read_hf_config, translate_config
    from recap.model.loader import build_model

    dtype, quant = FORMATS[fmt]
    meta = build_model(translate_config(read_hf_config(folder)), getattr(torch, dtype), "meta")
    try:
        from recap.model.head_format import head_backend
    except ImportError:  # a recap before the head's own format
        return serving_weight_bytes_lower_bound(meta, quant)
    return serving_weight_bytes_lower_bound(meta, quant, head_backend(quant))


def run_one(folder: Path, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One child, its RSS watched; killed past the ceiling."""
    ceiling = args.rss_ceiling or max(_mem_available() - args.margin, GIB)
    env = {**os.environ, "PYTHONPATH": str(args.recap_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", str(folder), "--format", fmt, "--max-model-len",
           str(args.max_model_len), "--kv-cache-bytes", str(args.kv_cache_bytes), "--state-cache-bytes",
           str(args.state_cache_bytes), "--decode-steps", str(args.decode_steps)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = 0
    while proc.poll() is None:
        rss, avail = _status(proc.pid).get("VmRSS", 0), _mem_available()
        watched = max(watched, rss)
        if rss > ceiling or avail < args.floor:  # the floor: other processes' memory grows meanwhile
            proc.kill()
            proc.wait()
            why = (f"RSS {rss / GIB:.2f} GiB passed the ceiling {ceiling / GIB:.2f} GiB" if rss > ceiling else
                   f"MemAvailable fell to {avail / GIB:.2f} GiB (floor {args.floor / GIB:.2f}) at RSS "
                   f"{rss / GIB:.2f} GiB")
            return {"killed": why, "peak": rss}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"failed": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"}
    row = json.loads(out.strip().splitlines()[-1])
    row["watched_peak"] = watched
    return row


def judge(row: dict[str, Any], own: int) -> dict[str, Any]:
    row["own_weights"] = own
    if "steady_rss" not in row:
        return row
    base = own + row["kv"] + row["state"]
    row["ratio"] = row["steady_rss"] / base
    row["target"] = TARGET_FACTOR * base + TARGET_SLACK
    row["meets_target"] = row["steady_rss"] <= row["target"]
    if row.get("plan_total"):
        row["load_within_plan"] = row["load_peak"] <= 1.1 * row["plan_total"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | format | own weights | plan weights + copies | pools | load peak | steady RSS | "
            "steady / (own + pools) | target (1.15x + 0.5 GiB) | meets | plan total | decode ms/token |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
        if "steady_rss" not in r:
            why = r.get("refused") or r.get("killed") or r.get("failed") or r.get("unsupported")
            lines.append(f"| {r['model']} | {r['format']} | {g(r['own_weights'])} | | | | | | | {why} |")
            continue
        lines.append(
            f"| {r['model']} | {r['format']} | {g(r['own_weights'])} | {g(r['plan_weights'])} + "
            f"{g(r['plan_copies'])} | {g(r['kv'] + r['state'])} | {g(r['load_peak'])} | {g(r['steady_rss'])} | "
            f"{r['ratio']:.2f} | {g(r['target'])} | {'yes' if r['meets_target'] else 'no'} | "
            f"{g(r['plan_total']) if r.get('plan_total') else ''} | "
            f"{'' if r.get('decode_ms_per_token') is None else format(r['decode_ms_per_token'], '.0f')} |"
        )
    return "\n".join(lines) + "\n(GiB)"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from real_shapes import DEFAULT_CACHE, SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=["granite-h-1b", "lfm2-1.2b"],
                   help="default: the two ~1.2B shapes (granite-h-7b, nemotron-h-8b: 7-8B ones, 14-16 GB of "
                        "bf16 on disk)")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=None,
                   help="default: fp32 bf16 int8, and int4 where this recap offers it")
    p.add_argument("--quick", action="store_true", help="one shape (lfm2-1.2b), one format (bf16)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--recap-path", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the recap the children import (default: this checkout)")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--state-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rss-ceiling", type=int, default=None, help="bytes; default MemAvailable - --margin")
    p.add_argument("--margin", type=int, default=3 * GIB // 2)
    p.add_argument("--floor", type=int, default=2 * GIB,
                   help="bytes: kill the child when the machine's MemAvailable falls below this")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--format", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    from real_shapes import build_checkpoint

    from recap.model.quant import QUANTIZATIONS

    formats = args.formats or ["fp32", "bf16", "int8"] + (["int4"] if "int4" in QUANTIZATIONS else [])
    shapes = args.shapes
    if args.quick:
        shapes, formats = ["lfm2-1.2b"], ["bf16"]
    rows = []
    for shape in shapes:
        folder = build_checkpoint(shape, args.cache_dir)
        for fmt in formats:
            print(f"{shape} {fmt}: MemAvailable {_mem_available() / GIB:.1f} GiB ...", file=sys.stderr, flush=True)
            row = judge({"model": shape, "format": fmt, **run_one(folder, fmt, args)}, own_weight_bytes(folder, fmt))
            rows.append(row)
            if "plan" in row:
                print(f"memory plan: {row['plan']}", file=sys.stderr, flush=True)
            print(json.dumps({k: v for k, v in row.items() if k != "plan"}), file=sys.stderr, flush=True)
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"recap_path": str(args.recap_path), "kv_cache_bytes": args.kv_cache_bytes,
                "state_cache_bytes": args.state_cache_bytes, "max_model_len": args.max_model_len,
                "decode_steps": args.decode_steps,
                "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}  # fmt: skip
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
