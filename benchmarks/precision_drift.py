"""Logit drift of reduced-precision weights against fp32 on the same prompts (bf16 weights, int8 or int4 linears).

    .venv/bin/python benchmarks/precision_drift.py [--models mamba2-115m hybrid-163m] [--precisions int8 int4]

For each model and precision: max |logit - fp32 logit| over every position of three random prompts
(45, 130 and 300 tokens), divided by max |fp32 logit|; the relative L2 distance; and how often the greedy
token (argmax) agrees with fp32's. Figures do not depend on machine load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import DEFAULT_CACHE, build_checkpoint  # noqa: E402

from recap.backends import prepare  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step  # noqa: E402

PROMPTS = (45, 130, 300)
PRECISIONS = {"bf16": {"dtype": torch.bfloat16}, "int8": {"quantization": "int8"}, "int8+bf16": {
    "dtype": torch.bfloat16, "quantization": "int8"}, "int4": {"quantization": "int4"}}


def logits(lm, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    blocks = list(range(1, 2 + len(ids) // 16))
    caches = ModelCaches.allocate(lm.config, len(blocks) + 1, 16, 2, lm.model.dtype)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, blocks, state_slot=1)])
    return lm.model.compute_logits(hidden)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mamba2-115m", "hybrid-163m"])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<12} {'weights':<10} {'max|dlogit|/max|logit|':>23} {'rel L2':>8} {'argmax agree':>13}")
    for name in args.models:
        path = build_checkpoint(name, args.cache_dir / name)
        ref_lm = load_model(path)
        prepare(ref_lm)  # as the engine's runner runs it
        vocab = ref_lm.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in PROMPTS]
        refs = [logits(ref_lm, p) for p in prompts]
        for label in args.precisions:
            lm = load_model(path, **PRECISIONS[label])
            prepare(lm)
            got = [logits(lm, p) for p in prompts]
            ref, new = torch.cat(refs), torch.cat(got)
            rel_max = ((new - ref).abs().max() / ref.abs().max()).item()
            rel_l2 = ((new - ref).norm() / ref.norm()).item()
            agree = (new.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"{name:<12} {label:<10} {rel_max:>23.4f} {rel_l2:>8.4f} {agree:>12.1%}")


if __name__ == "__main__":
    main()
