"""The ops the routed experts' pair alignment dispatches, torch reference against the one Triton launch (a proxy
for GPU launches; as benchmarks/count_attention_ops.py: its OpCounter counts aten ops and a Triton grid call
under TRITON_INTERPRET=1 as one launch; "launching" = compute ops + Triton launches).

    PYTHONPATH=. .venv/bin/python benchmarks/count_moe_ops.py [--tokens 1 64] [--experts 8 128] [--top-k 8]

For each (tokens, experts) with random top-k routing: the launching ops of align_pairs (kernels/moe.py), of
align_pairs_triton (kernels/triton/moe_align.py), and of one whole fused_moe call (which takes the latter within
its limits), D = I = 32. Per MoE layer and step; the whole-model view is benchmarks/count_block_ops.py.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from count_attention_ops import OpCounter, count_triton, launching  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from recap.kernels.moe import align_pairs  # noqa: E402
from recap.kernels.triton.fused_moe import BLOCK_M, fused_moe  # noqa: E402
from recap.kernels.triton.moe_align import align_pairs_triton  # noqa: E402


def count(fn: Callable[..., Any], *args: Any) -> Counter[str]:
    """The ops of one call of fn(*args)."""
    counter = OpCounter()
    original = count_triton(counter)
    try:
        with counter, torch.no_grad():
            counter.active = True
            fn(*args)
            counter.active = False
    finally:
        interpreter.GridExecutor.__call__ = original  # type: ignore[method-assign]
    return counter.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ops", action="store_true", help="list the reference's ops")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        for num_experts in args.experts:
            k = min(args.top_k, num_experts)
            ids = torch.rand(tokens, num_experts, generator=gen).topk(k, dim=-1).indices
            weights = torch.rand(tokens, k, generator=gen)
            x = torch.randn(tokens, 32, generator=gen)
            w_in = torch.randn(num_experts, 64, 32, generator=gen)  # gated: I = 32
            w_out = torch.randn(num_experts, 32, 32, generator=gen)
            ref = count(align_pairs, ids, num_experts, BLOCK_M)
            one = count(align_pairs_triton, ids, num_experts, BLOCK_M)
            whole = count(fused_moe, x, w_in, w_out, ids, weights)
            print(f"T={tokens} E={num_experts} k={k}: align_pairs {launching(ref)} launching, align_pairs_triton "
                  f"{launching(one)}, fused_moe {launching(whole)}")  # fmt: skip
            if args.ops:
                print("   ", ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(ref.items())))


if __name__ == "__main__":
    main()
