"""Compile a Triton kernel for sm_90 through ptxas with no GPU: what only the compiler refuses (the interpreter
runs any Python) fails in a CPU test. Needs triton imported with TRITON_INTERPRET=0 (jit helpers are decorated
at import), so callers run it in a fresh process."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for_hopper(
    fn: triton.JITFunction,
    pointers: dict[str, str],
    consts: dict,
    num_warps: int = 4,
    floats: tuple[str, ...] = (),
) -> str:
    """Integer arguments are i32 (those in `floats` fp32), strides specialized as divisible by 16 the way a
    launch with such strides specializes them. Returns the PTX."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.startswith("stride") or n in pointers}
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    return compiled.asm["ptx"]
