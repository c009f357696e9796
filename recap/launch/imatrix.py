"""`recap imatrix MODEL --data FILE --out FILE [--ctx 512] [--chunks N]`: an importance matrix for int4
(model/activation_stats.py collects it; `--quantization-imatrix FILE` uses it: model/importance.py)."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def add_imatrix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="model folder or hub id (run in float32, unquantized)")
    p.add_argument("--data", required=True, help="calibration text (UTF-8); never the text you will score")
    p.add_argument("--out", required=True, help="the safetensors file to write")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-imatrix -c)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: the whole text)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")


def run_imatrix(args: argparse.Namespace) -> int:
    from recap.model import activation_stats
    from recap.model.loader import load_model, load_tokenizer

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    try:
        loaded = load_model(args.model, torch.float32, linear_backend="torch")
        tok = load_tokenizer(loaded.path)
        with open(args.data, encoding="utf-8") as f:
            ids = tok(f.read(), add_special_tokens=False)["input_ids"]
        chunks = activation_stats.token_chunks(ids, args.ctx, args.chunks)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    stats = activation_stats.collect(loaded.model, chunks)
    out = activation_stats.save(stats, args.out, args.ctx)
    print(f"{out}: {len(stats.means())} layers over {stats.tokens} tokens ({stats.chunks} chunks of {args.ctx}) in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return 0
