"""One-row fp32 linear (batch-1 decode): a torch.compile'd multiply-sum over the [out, in] weight.

At one input row a linear layer is a mat-vec: every weight byte is read once and used once, so its speed is
the memory bandwidth the kernel reaches. oneDNN's packed linear (layers/linear.py), MKL's sgemv (`F.linear`,
`torch.mv`) and eager `(W * x).sum(-1)` all read the weight at 60-80% of the rate of the kernel inductor
generates for `(W * x).sum(-1)` (one pass over W's rows, vectorized along `in`, no temporary). Measured on the
2-core AVX-512 EPYC, 1 thread, thread CPU time, weights cycled through 200 MB so that they come from memory
(load 8-10 from other jobs; docs/performance.md): 768 -> 3352 0.65 vs 0.81 ms (oneDNN), 1536 -> 768 0.27 vs
0.43 ms, 768 -> 32000 4.6-5.0 vs 6.8-7.1 ms.

The kernel is compiled once per process with dynamic shapes (one kernel for every weight shape; the weight must
come as a plain tensor, not a Parameter, whose shape dynamo keeps static). The first compile on a machine cost
44-46 s (inductor's C++ toolchain and cache warm-up), 4-10 s in later processes, so it is opt-in:
`load_model(..., compile_decode=True)`, `EngineConfig.compile_decode`, `recap serve --compile-decode`.
`rowvec_linear_ref` is the plain reference (`F.linear`); the two agree to fp32 rounding (the sum runs in
another order), not bitwise.

Only 1-thread processes use it (the layer keeps its backend whenever torch runs more than one thread): the
2-thread mat-vec could not be measured on the shared machine, so nothing says it gains there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class RowVecUnavailableError(RuntimeError):
    """torch.compile (inductor, a C++ compiler) cannot build the one-row kernel on this machine."""


def _mul_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).sum(-1)  # (1, in) * (out, in) -> (out,)


@functools.cache
def _compiled() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The compiled kernel, built and checked once per process (raises RowVecUnavailableError)."""
    fn = torch.compile(_mul_sum, dynamic=True, fullgraph=True)
    w = torch.randn(24, 40)  # a weight: a tensor made outside inference mode
    try:
        with torch.inference_mode():  # x as a decode step's activations (the compiled function guards on it)
            x = torch.randn(1, 40)
            y = fn(w, x)
    except Exception as e:  # noqa: BLE001 (inductor raises many kinds: no compiler, no headers, ...)
        raise RowVecUnavailableError(f"torch.compile could not build the one-row kernel: {e}") from e
    if not torch.allclose(y, (x @ w.T)[0], rtol=1e-5, atol=1e-5):
        raise RowVecUnavailableError("the compiled one-row kernel disagrees with F.linear")
    return fn


def rowvec_available() -> bool:
    """Whether the compiled kernel builds here (compiles it on first call: seconds to tens of seconds)."""
    try:
        _compiled()
    except RowVecUnavailableError as e:
        logger.warning("%s", e)
        return False
    return True


def use_rowvec(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call takes the one-row kernel: one fp32 row, an fp32 weight, torch on one thread."""
    return x.shape[0] == 1 and x.dtype == torch.float32 and weight.dtype == torch.float32 and (
        torch.get_num_threads() == 1
    )


def rowvec_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] fp32, weight [out, in] -> [1, out]: the compiled mat-vec (reference: rowvec_linear_ref)."""
    y = _compiled()(weight, x).unsqueeze(0)
    return y if bias is None else y.add_(bias)


def rowvec_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain reference of rowvec_linear."""
    return F.linear(x, weight, bias)
