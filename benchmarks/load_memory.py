"""Peak and steady resident memory of loading a model and preparing it to serve, one fresh process per format.

    PYTHONPATH=. .venv/bin/python benchmarks/load_memory.py [--cache-dir bench_cache] [--formats fp32 bf16 int8]

The checkpoint: a seeded random Mamba2 (d_model 768, 8 layers, vocab 16000, untied head, 54M parameters, fp32 on
disk), built once with transformers. Each format loads it in its own process (`load_model` then `prepare`, as
the engine's runner does, one thread) and reads VmHWM (peak) and VmRSS (steady) from /proc/self/status: first
after importing torch and recap (the baseline), then after loading and preparing. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8")}
CONFIG = {"hidden_size": 768, "num_hidden_layers": 8, "num_heads": 24, "head_dim": 64, "vocab_size": 16000,
          "n_groups": 1, "state_size": 64, "tie_word_embeddings": False}  # fmt: skip

def build_checkpoint(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        from recap.model.testing import make_tiny_checkpoint

        make_tiny_checkpoint("mamba2", path, seed=0, **CONFIG)
    return path


def measure(path: Path, fmt: str) -> dict:
    dtype, quant = FORMATS[fmt]
    out = subprocess.run([sys.executable, "-m", "recap.bench.load_probe", str(path), dtype, quant or "-"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=Path("bench_cache"))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = build_checkpoint(args.cache_dir / "mamba2-54m-untied")
    mib = 1 << 20
    results = {}
    print(f"{'format':6} {'baseline':>9} {'load peak':>10} {'load rss':>9} {'peak':>8} {'steady':>8}  (MiB)")
    for fmt in args.formats:
        r = results[fmt] = measure(path, fmt)
        print(f"{fmt:6} {r['baseline_rss'] / mib:9.0f} {r['loaded_peak'] / mib:10.0f} {r['loaded_rss'] / mib:9.0f} "
              f"{r['peak'] / mib:8.0f} {r['rss'] / mib:8.0f}", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
