"""Perplexity of the trained default model with int4 weights everywhere (`head_quantization="same"`) vs int4 with
the output head at int8 (`head_quantization="int8"`, int4's default: model/head_format.py), the embedding as int8
rows in both, beside fp32: llama.cpp's protocol (chunks of `--ctx`, second halves scored), so the figures sit
beside `benchmarks/perplexity_peers.py`'s Q4_K_M row (docs/default_model.md).

    python benchmarks/perplexity_mixed_head.py --data heldout.txt [--model draft] [--ctx 512 --chunks 32]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

from recap.backends import prepare
from recap.backends.base import Backend
from recap.bench.perplexity import llama_cpp_score_from, llama_cpp_windows
from recap.model.cache import ModelCaches
from recap.model.loader import load_model
from recap.model.testing import SeqSpec, forward_step
from recap.model.trained_default import default_model_path, draft_model_path

# mode -> load_model's (quantization, head_quantization)
MODES = {"fp32": (None, "auto"), "int4": ("int4", "same"), "int4+head8": ("int4", "int8")}


def prepared(path: Path, mode: str) -> tuple[torch.nn.Module, Backend]:
    """The model in `mode` and the backend that prepared it."""
    quantization, head = MODES[mode]
    lm = load_model(path, quantization=quantization, head_quantization=head)
    return lm.model, prepare(lm)


def perplexity(model: torch.nn.Module, backend: Backend, windows: list[list[int]], first: int) -> float:
    nll, n = 0.0, 0
    for w in windows:
        blocks = list(range(1, 2 + len(w) // 16))
        caches = ModelCaches.allocate(model.config, len(blocks) + 1, 16, 2, torch.float32)
        hidden, _ = forward_step(model, caches, [SeqSpec(w, 0, blocks, state_slot=1)], backend)
        logp = model.compute_logits(hidden).log_softmax(-1)
        target = torch.tensor(w[first:])
        nll -= logp[first - 1 : len(w) - 1].gather(1, target[:, None]).sum().item()
        n += len(target)
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", choices=("main", "draft"), default="main")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path() if args.model == "main" else draft_model_path()
    ids = AutoTokenizer.from_pretrained(path)(args.data.read_text())["input_ids"]
    windows = llama_cpp_windows(ids, args.ctx, None, args.chunks or None)
    base = None
    for mode in MODES:
        ppl = perplexity(*prepared(path, mode), windows, llama_cpp_score_from(args.ctx))
        base = base or ppl
        print(f"| {args.model} | {mode} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
