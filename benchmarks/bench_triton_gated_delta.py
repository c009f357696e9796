"""The Triton gated delta rule kernels (recap/kernels/triton/gdn.py, kda.py) on a GPU: prefill and decode
speed at ~1-3B hybrid shapes, and the prefill's distance from the torch fast path (fp32 math).

    python benchmarks/bench_triton_gated_delta.py [--tokens 8192] [--reps 10] [--pieces 16 32 64 1]
        [--chunks 32 64] [--out bench_out/bench_triton_gated_delta.json]

Shapes (bf16 q/k/v, fp32 g/beta and states, seeded):
- gdn: a Qwen3.5-like GDN layer (16 key heads, 32 value heads, dims 128, one decay per head);
- kda: a Kimi-Linear-like KDA layer (32 heads, dims 128, one decay per key channel; q, k normalised inside).
Prefill: one --tokens row from a zero state, chunk grid 64, a checkpoint every 1024 tokens; GDN's per-row walk
and KDA's per-row walk at each --pieces size (1: the per-token form, GDN only), their chunk-parallel form at
each --chunks size, and triton kda's own choice (the chunk form at this length). Decode:
gated_delta_rule_update at batch 1, 32 and 128 (state traffic in GB/s: read + write of every fp32 state).
Medians of CUDA-event times. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from recap.bench.timing import cuda_median_ms
from recap.kernels.batch import build_forward_batch
from recap.kernels.gdn import gated_delta_rule as torch_varlen
from recap.kernels.gdn import l2_normalize
from recap.kernels.metadata import SeqSpec, SSMMetadata

HK, HV, D = 16, 32, 128
CKPT_EVERY, SLOTS = 1024, 16


def _meta(t: int) -> SSMMetadata:
    cps = [(p, 1 + i) for i, p in enumerate(range(CKPT_EVERY, t + 1, CKPT_EVERY))][: SLOTS - 1]
    fb = build_forward_batch([SeqSpec([0] * t, 0, state_slot=0, checkpoints=cps)], block_size=16,
                             chunk_size=64, with_attention=False, with_ssm=True, device="cuda")  # fmt: skip
    assert fb.ssm is not None
    return fb.ssm


def _inputs(t: int, hk: int, per_channel: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = (l2_normalize(torch.randn(t, hk, D, device="cuda", generator=gen)) * D**-0.5).bfloat16()
    k = l2_normalize(torch.randn(t, hk, D, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(t, HV, D, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(t, HV, *((D,) if per_channel else ()), device="cuda", generator=gen) * 0.1
    return q, k, v, g, torch.rand(t, HV, device="cuda", generator=gen)


def _timed_forms(op: str, forms: list, y_ref: torch.Tensor, ref_state: torch.Tensor, meta: SSMMetadata, t: int,
                 reps: int) -> list[dict[str, Any]]:  # fmt: skip
    """Each form (name, partial taking state= and meta=) timed from a zero state, with its output's and final
    states' max error relative to the torch fast path's."""
    rows = []
    for name, fn in forms:
        state = torch.zeros_like(ref_state)
        ms = cuda_median_ms(partial(fn, state=state, meta=meta), reps)
        y = fn(state=state, meta=meta).float()
        err = {"out_rel_err": ((y - y_ref).abs().max() / y_ref.abs().max()).item(),
               "state_rel_err": ((state - ref_state).abs().max() / ref_state.abs().max()).item()}  # fmt: skip
        rows.append({"op": op, "impl": name, "tokens": t, "ms": ms, **err})
    return rows


def prefill(t: int, reps: int, pieces: list[int], chunks: list[int]) -> list[dict[str, Any]]:
    from recap.kernels.kda import kda as torch_kda
    from recap.kernels.triton.gdn import run_varlen
    from recap.kernels.triton.gdn_chunk import chunk_gated_delta_rule
    from recap.kernels.triton.kda import kda

    meta, rows = _meta(t), []
    args = _inputs(t, HK, False)
    ref_state = torch.zeros(SLOTS, HV, D, D, device="cuda")
    ref_ms = cuda_median_ms(lambda: torch_varlen(*(x.float() for x in args), ref_state, meta), 1)
    y_ref = torch_varlen(*(x.float() for x in args), ref_state, meta)
    rows.append({"op": "gdn prefill", "impl": "torch fast path (fp32)", "tokens": t, "ms": ref_ms})
    forms = [(f"triton piece {p}", partial(run_varlen, *args, slot_positions=None, piece=p, norm_qk=False))
             for p in pieces]  # fmt: skip
    forms += [(f"triton chunk {c}", partial(chunk_gated_delta_rule, *args, slot_positions=None, chunk=c))
              for c in chunks]  # fmt: skip
    rows += _timed_forms("gdn prefill", forms, y_ref, ref_state, meta, t, reps)
    kargs = _inputs(t, HV, True)  # KDA normalises q and k itself (again here: the timing is the same)
    kref_state = torch.zeros_like(ref_state)
    ref_ms = cuda_median_ms(lambda: torch_kda(*(x.float() for x in kargs), kref_state, meta), 1)
    y_ref = torch_kda(*(x.float() for x in kargs), kref_state, meta).float()
    rows.append({"op": "kda prefill", "impl": "torch fast path (fp32)", "tokens": t, "ms": ref_ms})
    forms = [(f"triton piece {p}", partial(run_varlen, *kargs, slot_positions=None, piece=p, norm_qk=True))
             for p in pieces if p > 1]  # fmt: skip
    forms += [(f"triton chunk {c}", partial(chunk_gated_delta_rule, *kargs, slot_positions=None, chunk=c,
                                            normalize_qk=True)) for c in chunks]  # fmt: skip
    forms.append(("triton kda (the op's choice)", partial(kda, *kargs)))
    rows += _timed_forms("kda prefill", forms, y_ref, kref_state, meta, t, reps)
    for r in rows:
        r["ktok_per_s"] = r["tokens"] / r["ms"]
    return rows


def decode(reps: int) -> list[dict[str, Any]]:
    from recap.kernels.triton.gdn import gated_delta_rule_update

    rows = []
    for b in (1, 32, 128):
        q, k, v, g, beta = _inputs(b, HK, False)
        state, idx = torch.randn(b, HV, D, D, device="cuda"), torch.arange(b, device="cuda")
        ms = cuda_median_ms(partial(gated_delta_rule_update, state, q, k, v, g, beta, idx), reps)
        gbs = b * HV * D * D * 4 * 2 / (ms * 1e-3) / 1e9
        rows.append({"op": "gdn decode", "batch": b, "us": ms * 1e3, "state_GB_per_s": gbs})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pieces", type=int, nargs="+", default=[16, 32, 64, 1])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--out", type=Path, default=Path("bench_out/bench_triton_gated_delta.json"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_triton_gated_delta needs a CUDA device")
    rows = prefill(a.tokens, a.reps, a.pieces, a.chunks) + decode(a.reps)
    for r in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
