"""The Triton conv1d and Mamba1 selective scan against recap's torch kernels, on a GPU.

Prefill: one row of T tokens (bf16 activations, fp32 state, checkpoints every 1024 tokens); decode: B rows
of one token. Prints one line per measurement (median ms, effective GB/s of the bytes each kernel must
move, max |triton - torch| / max |torch| on the outputs) and the whole as JSON.

    PYTHONPATH=. python benchmarks/bench_triton_conv_scan.py [--tokens 8192] [--channels 5120]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

import torch

from recap.bench.timing import cuda_median_ms
from recap.kernels import conv1d as torch_conv
from recap.kernels import selective_scan as torch_scan
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.triton import conv1d as triton_conv
from recap.kernels.triton import selective_scan as triton_scan

DEV = torch.device("cuda")
STATE_N, CONV_K, SLOTS = 16, 4, 160


def _meta(lengths: list[int], context: int, every: int) -> SSMMetadata:
    specs = []
    for r, n in enumerate(lengths):
        cps = [(p, len(lengths) + 8 * r + k) for k, p in enumerate(range(context + every, context + n + 1, every))]
        specs.append(SeqSpec(token_ids=[0] * n, context_len=context, state_slot=r, checkpoints=cps))
    fb = build_forward_batch(specs, block_size=16, chunk_size=256, with_attention=False, with_ssm=True, device=DEV)
    assert fb.ssm is not None
    return fb.ssm


def _case(name: str, nbytes: int, fast: Callable[[], torch.Tensor], base: Callable[[], torch.Tensor],
          iters: int) -> dict[str, float | str]:  # fmt: skip
    """Each callable owns its state copies: their first calls see the same state and are compared."""
    a, b = fast().float(), base().float()
    diff = float((a - b).abs().max() / b.abs().max())  # relative to the output's scale
    t_fast, t_base = cuda_median_ms(fast, iters), cuda_median_ms(base, max(2, iters // 4))
    gbps = nbytes / t_fast / 1e6
    row = {"case": name, "triton_ms": t_fast, "torch_ms": t_base, "triton_GBps": gbps, "rel_diff": diff}
    print(f"{name:24s} triton {t_fast:9.3f} ms  torch {t_base:9.3f} ms  {gbps:8.1f} GB/s  rel diff {diff:.2g}")
    return row


def _conv_cases(t: int, d: int, batches: list[int]) -> list[dict[str, float | str]]:
    w, b = torch.randn(d, CONV_K, device=DEV).bfloat16(), torch.randn(d, device=DEV).bfloat16()
    cache = torch.randn(SLOTS, d, CONV_K - 1, device=DEV).bfloat16()
    x = torch.randn(t, d, device=DEV).bfloat16()
    meta = _meta([t], 0, 1024)
    out = [_case(f"conv prefill T={t}", 2 * 2 * t * d,
                 lambda: triton_conv.causal_conv1d(x, w, b, cache, meta),
                 lambda: torch_conv.causal_conv1d(x, w, b, cache, meta), 20)]  # fmt: skip
    for nb in batches:
        xb, idx = torch.randn(nb, d, device=DEV).bfloat16(), torch.arange(nb, device=DEV)
        out.append(_case(f"conv decode B={nb}", nb * d * 2 * (2 * (CONV_K - 1) + 2),
                         partial(triton_conv.causal_conv1d_update, xb, cache.clone(), w, b, idx),
                         partial(torch_conv.causal_conv1d_update, xb, cache.clone(), w, b, idx), 50))  # fmt: skip
    return out


def _scan_inputs(t: int, i: int) -> list[torch.Tensor]:
    u, dt, z = (torch.randn(t, i, device=DEV).bfloat16() for _ in range(3))
    B, C = (torch.randn(t, STATE_N, device=DEV).bfloat16() for _ in range(2))
    return [u, dt, B, C, z]


def _scan_cases(t: int, i: int, batches: list[int]) -> list[dict[str, float | str]]:
    A = -torch.rand(i, STATE_N, device=DEV) * 4
    D, bias = torch.randn(i, device=DEV), torch.randn(i, device=DEV)
    cache = torch.randn(SLOTS, i, STATE_N, device=DEV)
    u, dt, B, C, z = _scan_inputs(t, i)
    meta = _meta([t], 0, 1024)
    args = (u, dt, A, B, C, D, z, bias, True)
    out = [_case(f"scan prefill T={t}", t * i * 2 * 4 + t * STATE_N * 4,
                 lambda: triton_scan.selective_scan(*args, cache, meta),
                 lambda: torch_scan.selective_scan(*args, cache, meta), 5)]  # fmt: skip
    for nb in batches:
        ub, dtb, Bb, Cb, zb = _scan_inputs(nb, i)
        idx, pos = torch.arange(nb, device=DEV), torch.full((nb,), 100, device=DEV)
        a = (ub, dtb, A, Bb, Cb, D, zb, bias, True, idx)
        out.append(_case(f"scan decode B={nb}", nb * i * STATE_N * 4 * 2,
                         partial(triton_scan.selective_state_update, cache.clone(), *a, None, pos),
                         partial(torch_scan.selective_state_update, cache.clone(), *a, None, pos), 50))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--channels", type=int, default=5120, help="conv channels and Mamba1 d_inner")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"T={args.tokens} channels={args.channels}")
    rows = _conv_cases(args.tokens, args.channels, args.batches) + _scan_cases(args.tokens, args.channels, args.batches)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
