"""Equal bytes, swept: replay one memory budget split between KV and state at several points.

At equal bytes (a fixed total for KV blocks plus state slots) the hit rate of a hybrid cache moves
by +-0.6 point between neighbouring splits on the Mooncake trace (docs/replay.md): which documents
survive in KV is chaotic. One split's figure is therefore one draw; this study reports the whole
curve and its median, the figure to compare policies and changes on.

    python benchmarks/equal_bytes_sweep.py --trace /work/shared/traces/synthetic_trace.jsonl \
        --total-bytes 80GB --kv-gb 75 79.5 0.5 --policy recap [--jobs 2] [--json-out FILE]

Each split runs `python -m recap.bench.replay` in its own process (`--jobs` at a time: the replay is
single-threaded). Prints a table (split x policy), the median / mean / min / max per policy, and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from recap.units import parse_bytes

GB = 10**9


def run_split(trace: str, kv_bytes: int, state_bytes: int, policies: list[str], extra: list[str]) -> dict[str, float]:
    """Hit rate per policy for one split, from the replay's JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "recap.bench.replay", "--trace", trace, "--kv-cache-bytes", str(kv_bytes)]
        cmd += ["--state-cache-bytes", str(state_bytes), "--policy", *policies, "--json-out", str(out), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"replay failed at {kv_bytes} + {state_bytes} bytes:\n{done.stderr}")
        return json.loads(out.read_text())["hit_rate"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--total-bytes", default="80GB", help="KV + state budget, e.g. 80GB")
    p.add_argument(
        "--kv-gb",
        nargs=3,
        type=float,
        default=[75.0, 79.5, 0.5],
        metavar=("FROM", "TO", "STEP"),
        help="KV budgets to try, in GB (10^9 bytes), inclusive; the state gets the rest",
    )
    p.add_argument("--policy", nargs="+", default=["recap"])
    p.add_argument("--jobs", type=int, default=2, help="replays at once")
    p.add_argument("--json-out", type=Path, default=None)
    args, extra = p.parse_known_args(argv)  # anything else goes to the replay (e.g. --limit)
    total = parse_bytes(args.total_bytes)
    start, stop, step = args.kv_gb
    if step <= 0 or start > stop:
        p.error("--kv-gb wants FROM <= TO and STEP > 0")
    kvs = [round((start + i * step) * GB) for i in range(int((stop - start) / step + 1e-9) + 1)]
    if kvs[-1] >= total:
        p.error(f"KV budgets must stay below --total-bytes ({args.total_bytes})")
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rates = list(pool.map(lambda kv: run_split(args.trace, kv, total - kv, args.policy, extra), kvs))
    header = "| KV GB | state GB | " + " | ".join(args.policy) + " |"
    print(header)
    print("|" + "---:|" * (2 + len(args.policy)))
    for kv, rate in zip(kvs, rates):
        cells = " | ".join(f"{100 * rate[name]:.2f}%" for name in args.policy)
        print(f"| {kv / GB:g} | {(total - kv) / GB:g} | {cells} |")
    summary: dict[str, dict[str, float]] = {}
    for name in args.policy:
        values = [rate[name] for rate in rates]
        summary[name] = {
            "median": statistics.median(values),
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
        }
        s = summary[name]
        print(
            f"{name}: median {100 * s['median']:.2f}%, mean {100 * s['mean']:.2f}%, "
            f"min {100 * s['min']:.2f}%, max {100 * s['max']:.2f}%"
        )
    line = json.dumps(
        {
            "trace": args.trace,
            "total_bytes": total,
            "splits": [{"kv_bytes": kv, "state_bytes": total - kv, "hit_rate": r} for kv, r in zip(kvs, rates)],
            "summary": summary,
        }
    )
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
