"""One-row (decode) and many-row (prefill) speed of the int4 and int8 linear kernels, two variants side by side,
called alternately (each first in turn) within every round on the same packed weights (both read one layout).
Variants: the csrc sources of a git revision (default main) and of this checkout, each compiled with native.py's
flags and run on this CPU's fastest path (--avx2: both on their AVX2 paths); or (--isa) this checkout's AVX2 path
against its AVX-512 VNNI one: int4 through the kernel's isa argument, int8 as a second build with -mno-avx512f
(AVX2, with AVX-VNNI where the CPU has it; without, vpmaddubsw over the 7-bit activation grid that quant.py picks
on such a CPU).

    .venv/bin/python benchmarks/bench_kernel_ab.py [--ref main [--avx2] | --isa] [--rows 1 64] [--rounds 7] \
        [--shapes lfm2]

Prints per (kernel, shape, rows): median ms per call of each build (the calling thread's CPU time: the other
processes of a shared box do not count, their memory traffic does), GB/s of weight bytes and its share of a plain
1 GiB read timed in the same rounds (torch.sum, 1 thread), ns per output and the ratio. Weights (and the read) are
on huge pages, as the CPU backend puts a model's, and cycled through >= 128 MB so that a one-row call reads its
weight from memory, as a decode step does (--hot: one copy, from cache where it fits). 1 thread. Also checks that
both builds give equal outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recap.backends.huge_pages import move_to_huge_pages  # noqa: E402
from recap.kernels.linear_int4 import ISAS, best_isa, quantize_int4, supported_isas  # noqa: E402
from recap.kernels.linear_rows import activation_grid, pack_int8  # noqa: E402
from recap.kernels.native import FLAGS, _compiler  # noqa: E402
from recap.model.quant import int8_activation_bits, quantize_int8_weight, row_sums  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# (in, out) of granite-h-1b's linears: mamba in_proj / out_proj, shared MLP in / out, the int8 head
# lfm2-1.2b's: MLP gate or up / down, short conv in_proj, q / o and k / v projections; its tied int8 head
SHAPES = {"granite": [(1536, 6448), (3072, 1536), (1536, 8192), (4096, 1536)], "head": [(1536, 100352)],
          "lfm2": [(2048, 8192), (8192, 2048), (2048, 6144), (2048, 2048), (2048, 512)],
          "lfm2_head": [(2048, 65536)]}


def build(src: str, name: str, tmp: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    c, so = tmp / f"{name}.c", tmp / f"{name}.so"
    c.write_text(src)
    subprocess.run([_compiler(), *FLAGS, *extra, "-o", str(so), str(c), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    if hasattr(lib, "recap_linear_int4"):
        lib.recap_linear_int4.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _INT, _P, _P, _INT, _INT]
        lib.recap_linear_int4.restype = _INT
    else:
        lib.recap_linear_i8.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _F32, _INT, _INT, _INT]
        lib.recap_linear_i8.restype = _INT
    return lib


def int4_call(lib: ctypes.CDLL, isa: int, k: int, out: int):  # type: ignore[no-untyped-def]
    def call(x: torch.Tensor, w, y: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        rc = lib.recap_linear_int4(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), out, w.group, int(w.asym),
                                   None, y.data_ptr(), 1, isa)
        assert rc == 0, rc
    return call


def int8_call(lib: ctypes.CDLL, seven_bit: bool, k: int, out: int):  # type: ignore[no-untyped-def]
    qscale, zp, qmax = activation_grid(seven_bit)

    def call(x: torch.Tensor, w, y: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        tiles, sums, scales = w
        rc = lib.recap_linear_i8(x.data_ptr(), x.shape[0], tiles.data_ptr(), sums.data_ptr(), scales.data_ptr(),
                                 out, k, None, y.data_ptr(), qscale, zp, qmax, 1)
        assert rc == 0, rc
    return call


def weights(kind: str, k: int, out: int, copies: int) -> list:  # type: ignore[type-arg]
    """`copies` packed weights, on transparent huge pages as the CPU backend puts a model's (from 4 KiB pages a
    one-row kernel streams well below the memory's rate: backends/huge_pages.py)."""
    g = torch.Generator().manual_seed(0)
    res = []
    for _ in range(copies):
        w = torch.randn(out, k, generator=g) * 0.02
        if kind == "int4":
            q4 = quantize_int4(w, 32)
            q4.packed = on_huge_pages(q4.packed)
            res.append(q4)
        else:
            q, s = quantize_int8_weight(w)
            res.append((on_huge_pages(pack_int8(q)), row_sums(q), s))
    return res


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    moved = move_to_huge_pages([t])
    return t if moved is None else moved[0]


def bench(kind: str, k: int, out: int, rows: int, variants: dict, rounds: int, hot: bool) -> None:  # type: ignore[type-arg]
    nbytes = out * k * (0.5 + 2 / 32 if kind == "int4" else 1)
    copies = max(1, min(16, int(128e6 // nbytes) + 1)) if rows == 1 and not hot else 1
    ws = weights(kind, k, out, copies)
    x = torch.randn(rows, k)
    calls = {n: make(k, out) for n, make in variants.items()}
    ys = {n: torch.empty(rows, out) for n in variants}
    for n, c in calls.items():
        c(x, ws[0], ys[n])
    same = all(torch.equal(ys[n], next(iter(ys.values()))) for n in ys)
    reps = max(1, int(3e8 // (nbytes * max(rows, 8))))
    times: dict[str, list[float]] = {n: [] for n in variants}
    reads: list[float] = []
    for i in range(rounds):
        # the order alternates (ABBA): the variant that ran first ran slower, the same build against itself 1.03-1.36x
        for n, c in list(calls.items())[:: 1 if i % 2 == 0 else -1]:
            t = time.thread_time()  # this thread's CPU time: the other processes of a shared box do not count
            for i in range(reps):
                c(x, ws[i % copies], ys[n])
            times[n].append((time.thread_time() - t) / reps)
        reads.append(read_seconds())
    med = {n: statistics.median(v) for n, v in times.items()}
    read_gbs = READ_BYTES / statistics.median(reads) / 1e9
    cells = [f"{n} {m * 1e3:7.3f} ms {nbytes / m / 1e9:5.1f} GB/s ({nbytes / m / 1e9 / read_gbs:4.0%}) "
             f"{m / out / rows * 1e9:6.2f} ns/out" for n, m in med.items()]  # fmt: skip
    names = list(med)
    ratio = med[names[0]] / med[names[-1]] if len(names) > 1 else 1.0
    print(f"{kind} {k}->{out} rows {rows}: " + " | ".join(cells) + f" | speedup {ratio:.2f}x equal={same} | "
          f"plain read {read_gbs:.1f} GB/s", flush=True)


READ_BYTES = 1 << 30


@functools.cache
def _read_buffer() -> torch.Tensor:
    return on_huge_pages(torch.ones(READ_BYTES // 4))


def read_seconds() -> float:
    """This thread's CPU time to sum 1 GiB of fp32 (torch.sum: the streaming read bandwidth one thread gets from
    memory, measured in the same rounds as the kernels, so under the same load)."""
    buf = _read_buffer()
    t = time.thread_time()
    buf.sum()
    return time.thread_time() - t


Variants = dict[str, dict[str, Callable]]  # kind -> name -> (k, out) -> call(x, w, y)


def build_variants(tmp: Path, ref: str, avx2: bool = False) -> Variants:
    """The csrc of git revision `ref` ('' none) and of this checkout, each on this CPU's fastest path, or (avx2)
    both on their AVX2 paths as isa_variants picks them (an AVX2 CPU's code on this one)."""
    variants: Variants = {}
    avxvnni = "avx_vnni" in Path("/proc/cpuinfo").read_text().split()
    seven = not avxvnni if avx2 else int8_activation_bits() == 7
    isa = ISAS.index("avx2") if avx2 else best_isa()
    for kind, name in (("int4", "linear_int4"), ("int8", "linear_int8")):
        path = f"recap/kernels/csrc/{name}.c"
        srcs = {"this": (ROOT / path).read_text()}
        if ref:
            srcs = {ref: subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True,
                                        text=True).stdout, **srcs}
        flags = ("-mno-avx512f",) if avx2 and kind == "int8" else ()
        libs = {n: build(src, f"{name}_{i}", tmp, flags) for i, (n, src) in enumerate(srcs.items())}
        variants[kind] = {n: (partial(int4_call, lib, isa) if kind == "int4" else partial(int8_call, lib, seven))
                          for n, lib in libs.items()}  # fmt: skip
    return variants


def isa_variants(tmp: Path) -> Variants:
    """This checkout's AVX2 and AVX-512 VNNI paths (int4: the isa argument; int8: a -mno-avx512f build, with the
    activation grid an AVX2 CPU uses: 8 bits with AVX-VNNI, 7 without)."""
    avx2, avx512 = ISAS.index("avx2"), ISAS.index("avx512_vnni")
    if avx512 not in supported_isas():
        raise SystemExit("--isa: this CPU has no AVX-512 VNNI")
    int4 = build((ROOT / "recap/kernels/csrc/linear_int4.c").read_text(), "linear_int4", tmp)
    src = (ROOT / "recap/kernels/csrc/linear_int8.c").read_text()
    int8_avx2, int8_avx512 = build(src, "linear_int8_avx2", tmp, ("-mno-avx512f",)), build(src, "linear_int8", tmp)
    avxvnni = "avx_vnni" in Path("/proc/cpuinfo").read_text().split()
    return {"int4": {"avx2": partial(int4_call, int4, avx2), "avx512vnni": partial(int4_call, int4, avx512)},
            "int8": {"avx2": partial(int8_call, int8_avx2, not avxvnni),
                     "avx512vnni": partial(int8_call, int8_avx512, False)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="git revision of the other build ('' for this checkout only)")
    ap.add_argument("--isa", action="store_true", help="this checkout's AVX2 path against its AVX-512 VNNI one")
    ap.add_argument("--avx2", action="store_true", help="with --ref: both builds on their AVX2 paths")
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=["granite", "head"], choices=sorted(SHAPES))
    ap.add_argument("--hot", action="store_true", help="one copy of each weight (from cache where it fits)")
    ap.add_argument("--kinds", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        variants = isa_variants(tmp) if args.isa else build_variants(tmp, args.ref, args.avx2)
        for kind in args.kinds:
            for shape in args.shapes:
                for k, out in SHAPES[shape]:
                    if kind == "int4" and shape.endswith("head"):
                        continue
                    for rows in args.rows:
                        bench(kind, k, out, rows, variants[kind], args.rounds, args.hot)


if __name__ == "__main__":
    main()
