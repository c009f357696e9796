"""KL divergence from fp32 of recap's formats and llama.cpp's quantizations, on the trained default models.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kl_divergence.py --data HELDOUT [--ctx 512] [--chunks 32]
        [--build-dir build/peers] [--out bench_out/kl_divergence.json] [--formats NAME ...] [--recap-only]

Perplexity differences between int4 formats are noise-sized at 9M parameters (docs/performance.md); this is
llama.cpp's sharper measure (llama-perplexity --kl-divergence). On llama.cpp's chunks (recap/bench/perplexity.py's
llama-cpp protocol: CHUNKS x CTX tokens, each chunk's second half scored), for each model:
- recap: the fp32 model is the base; every format's full-vocabulary logits at each scored position (the model
  run directly, window by window: load_model + prepare + forward_step + compute_logits) against fp32's, through
  recap/bench/kl_divergence.py's KlStats: mean KL(fp32 || format), its 99th percentile, top-1 agreement.
- llama.cpp: llama-perplexity on the f32 GGUF writes the base (--kl-divergence-base), then each other GGUF is
  compared with it (--kl-divergence); f32 against its own base shows the floor of that file's 16-bit log-probs.
The GGUFs are benchmarks/perplexity_peers.py's (run it first); the text's ids must be equal in both engines, and
the base file's tokens and positions are checked against recap's chunks, so both sides score the same positions.

recap's int4 formats other than its default are set through recap/model/layers/int4_linear.py's INT4_GROUP and
INT4_ASYM while the model loads (int4_format below): the loader has no argument for them (they exist for
measurements like this one and benchmarks/bench_int4.py). The super-block format (kernels/int4_superblock.py) has
one: quantization "int4_k".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_llama import LlamaCpp, ensure_llama, run_logged  # noqa: E402
from perplexity_peers import (  # noqa: E402
    MODELS,
    TARGETS,
    checkpoint_digest,
    gguf_add_bos,
    heldout_parser,
    hub_checkpoint,
    token_check,
)

# name -> (dtype, quantization, int4 (group, asymmetric, symmetric fit) or None); the first is the base
FORMATS: dict[str, tuple[torch.dtype, str | None, tuple[int, bool, str] | None]] = {
    "fp32": (torch.float32, None, None), "bf16": (torch.bfloat16, None, None), "int8": (torch.float32, "int8", None),
    "int4 sym g32 (default)": (torch.float32, "int4", (32, False, "weighted")),
    "int4 sym g32 lsq fit": (torch.float32, "int4", (32, False, "lsq")),  # the default's fit until 2026-11-29
    "int4 sym g64": (torch.float32, "int4", (64, False, "weighted")),
    "int4 asym g32": (torch.float32, "int4", (32, True, "weighted")),  # (the fit is the symmetric formats')
    "int4 asym g64": (torch.float32, "int4", (64, True, "weighted")),
    "int4 superblock (int4_k)": (torch.float32, "int4_k", None),
}  # fmt: skip
GGUF_TYPES = ("f32", "bf16", "q8_0", "Q4_K_M")  # f32 first: the base
CROSS = "fp32 vs llama.cpp f32"  # recap fp32 against llama.cpp's base: the two engines' fp32 models


@contextlib.contextmanager
def int4_format(fmt: tuple[int, bool, str] | None) -> Iterator[None]:
    """Int4Linear quantizes with these module globals when it is built; restored afterwards."""
    import recap.model.layers.int4_linear as m

    saved = m.INT4_GROUP, m.INT4_ASYM, m.INT4_SYM_FIT
    if fmt is not None:
        m.INT4_GROUP, m.INT4_ASYM, m.INT4_SYM_FIT = fmt
    try:
        yield
    finally:
        m.INT4_GROUP, m.INT4_ASYM, m.INT4_SYM_FIT = saved


def load(path: Path, name: str) -> tuple[Any, Any]:
    """(model, backend) of one format, as a runner prepares it (int4 and int8 with their int8 head)."""
    from recap.backends import prepare
    from recap.model.loader import load_model

    dtype, quant, fmt = FORMATS[name]
    with int4_format(fmt):
        lm = load_model(path, dtype=dtype, quantization=quant)
    return lm.model, prepare(lm)


def window_logits(model: Any, backend: Any, ids: list[int], score_from: int) -> torch.Tensor:
    """fp32 logits [len(ids) - score_from, V] of positions score_from-1 .. len(ids)-2 (those that predict the
    scored tokens), from one prefill of the window in fresh caches."""
    from recap.kernels.metadata import SeqSpec
    from recap.model.cache import ModelCaches
    from recap.model.testing import forward_step

    blocks = list(range(1, 2 + len(ids) // 16))
    caches = ModelCaches.allocate(model.config, len(blocks) + 1, 16, 2, model.dtype)
    with torch.no_grad():
        hidden, _ = forward_step(model, caches, [SeqSpec(ids, 0, blocks, state_slot=1)], backend)
        return model.compute_logits(hidden[score_from - 1 : len(ids) - 1]).float()


def recap_kl(path: Path, windows: list[list[int]], score_from: int, llama_base: Iterator[torch.Tensor] | None,
             formats: list[str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The formats' KlStats against fp32 over the windows' scored positions (fp32 against itself: 0), and
    CROSS: recap's fp32 against llama.cpp's f32 base (one [positions, V] log-prob tensor per window; not without
    llama_base). Each format also paired chunk by chunk with the first of `formats` ("paired": the mean over
    chunks of its mean KL and of its negative log-likelihood per scored token less the first format's, with
    standard errors over the chunks: the per-position figures of one chunk are not independent)."""
    from recap.bench.kl_divergence import KlStats

    models = {name: load(path, name) for name in ("fp32", *formats) if name in FORMATS}
    stats = {name: KlStats() for name in (*models, *((CROSS,) if llama_base is not None else ()))}
    nll: dict[str, list[float]] = {name: [] for name in models}  # per window
    bases = llama_base if llama_base is not None else iter([None] * len(windows))
    for w, lbase in zip(windows, bases, strict=True):
        base = window_logits(*models["fp32"], w, score_from)
        targets = torch.tensor(w[score_from:])
        for name, (model, backend) in models.items():
            logits = base if name == "fp32" else window_logits(model, backend, w, score_from)
            before = stats[name].nll
            stats[name].add(base, logits, targets)
            nll[name].append((stats[name].nll - before) / len(targets))
        if lbase is not None:
            stats[CROSS].add(lbase, base, targets)
    rows: dict[str, dict[str, Any]] = {name: s.summary() for name, s in stats.items()}
    ref = formats[0] if formats and formats[0] in models else None
    for name in [n for n in formats if n in models and n != ref] if ref is not None and len(windows) > 1 else ():
        dkl = torch.tensor([float(a.mean() - b.mean()) for a, b in zip(stats[name].kl, stats[ref].kl, strict=True)])
        dnll = torch.tensor(nll[name]) - torch.tensor(nll[ref])
        n = len(windows) ** 0.5
        rows[name]["paired"] = {"vs": ref, "dkl": float(dkl.mean()), "dkl_se": float(dkl.std() / n),
                                "dnll": float(dnll.mean()), "dnll_se": float(dnll.std() / n)}  # fmt: skip
    return rows


def llama_base_logprobs(base: Path) -> Iterator[torch.Tensor]:
    """llama-perplexity's base file, one chunk at a time: float64 log-probs [positions, V]. Each position is
    (scale, min) then 16-bit codes, log p = scale * code + min; like llama.cpp's reader, log p <= -16 counts as
    probability 0 (its writer clipped the logits 16 below the largest)."""
    import numpy as np

    with open(base, "rb") as f:
        _, n_ctx, n_vocab, n_chunk = struct.unpack("<8s3i", f.read(20))
        f.seek(4 * n_ctx * n_chunk, os.SEEK_CUR)
        per_chunk, nv = n_ctx - 1 - n_ctx // 2, 2 * ((n_vocab + 1) // 2) + 4
        for _ in range(n_chunk):
            a = np.frombuffer(f.read(2 * per_chunk * nv), dtype=np.uint16).reshape(per_chunk, nv)
            scale_min = a[:, :4].copy().view(np.float32)  # [positions, 2]
            lp = scale_min[:, :1].astype(np.float64) * a[:, 4 : 4 + n_vocab] + scale_min[:, 1:2]
            lp[lp <= -16.0] = -np.inf
            yield torch.from_numpy(lp)


def base_file_check(base: Path, windows: list[list[int]], bos: int | None, ctx: int) -> int:
    """The positions llama-perplexity's base file holds; SystemExit unless its chunks, BOS in front as
    llama-perplexity puts it, are recap's windows and its positions per chunk are the ones recap scores."""
    with open(base, "rb") as f:
        magic, n_ctx, n_vocab, n_chunk = struct.unpack("<8s3i", f.read(20))
        toks = torch.frombuffer(bytearray(f.read(4 * n_ctx * n_chunk)), dtype=torch.int32).tolist()
    chunks = [toks[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunk)]
    chunks = [[bos, *c[1:]] if bos is not None else c for c in chunks]
    per_chunk = n_ctx - 1 - n_ctx // 2  # llama-perplexity: logits n_ctx/2 .. n_ctx-2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    if magic != b"_logits_" or n_ctx != ctx or chunks != windows:
        raise SystemExit(f"{base}: its chunks are not recap's ({n_chunk} x {n_ctx} against {len(windows)} x {ctx})")
    if base.stat().st_size != 20 + 4 * n_ctx * n_chunk + 2 * nv * per_chunk * n_chunk:
        raise SystemExit(f"{base}: not {per_chunk} positions per chunk")
    return per_chunk * n_chunk


_LLAMA_STATS = {"mean_kl": r"Mean\s+KLD:\s+([-\d.]+)", "mean_kl_pm": r"Mean\s+KLD:\s+[-\d.]+\s+±\s+([\d.]+)",
                "kl_p99": r"99\.0%\s+KLD:\s+([-\d.]+)", "max_kl": r"Maximum KLD:\s+([-\d.]+)",
                "top1_agreement": r"Same top p:\s+([\d.]+)", "perplexity": r"Mean PPL\(Q\)\s+:\s+([\d.]+)"}  # fmt: skip


def llama_kl(llama: LlamaCpp, files: dict[str, Path], data: Path, args: argparse.Namespace,
             base: Path) -> dict[str, dict[str, float]]:  # fmt: skip
    """llama-perplexity: f32 writes `base`, then every GGUF (f32 too) against it; its printed statistics."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(llama.bin)}
    common = ["-c", str(args.ctx), "-b", str(args.ctx), "--chunks", str(args.chunks or -1), "-t", str(args.threads)]
    tool = str(llama.tool("llama-perplexity"))
    subprocess.run([tool, "-m", str(files["f32"]), "-f", str(data), "--no-escape", *common, "--kl-divergence-base",
                    str(base)], check=True, capture_output=True, env=env)  # fmt: skip
    cmds = {g: [tool, "-m", str(f), *common, "--kl-divergence-base", str(base), "--kl-divergence"]
            for g, f in files.items()}  # fmt: skip
    return {g: _llama_stats(cmd, base.with_suffix(f".{g}.log"), env) for g, cmd in cmds.items()}


def _llama_stats(cmd: list[str], log: Path, env: dict[str, str], tries: int = 3) -> dict[str, float]:
    """One llama-perplexity --kl-divergence run's printed statistics ("Same top p" is printed last)."""
    text = run_logged(cmd, log, re.compile(_LLAMA_STATS["top1_agreement"]), env, tries)
    found = {key: re.search(pat, text) for key, pat in _LLAMA_STATS.items()}
    if not all(found.values()):
        raise RuntimeError(f"KL statistics missing from llama-perplexity's output ({log}):\n{text[-2000:]}")
    row = {key: float(m.group(1)) for key, m in found.items() if m is not None}
    return row | {"top1_agreement": row["top1_agreement"] / 100.0}


def model_row(name: str, llama: LlamaCpp | None, args: argparse.Namespace) -> dict[str, Any]:
    """One model's rows; llama None (--recap-only): recap's formats only, on the chunks llama.cpp would take (no
    BOS: the trained models' GGUFs have no add_bos_token), no GGUFs needed."""
    from transformers import AutoTokenizer

    from recap.bench.perplexity import llama_cpp_score_from, llama_cpp_windows

    tok = AutoTokenizer.from_pretrained(str(MODELS[name]))
    ids = tok(args.data.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    score_from = llama_cpp_score_from(args.ctx)
    if llama is None:
        windows = llama_cpp_windows(ids, args.ctx, None, args.chunks or None)
        t = time.perf_counter()
        rrows = recap_kl(MODELS[name], windows, score_from, None, args.formats)
        print(f"{name}: recap {time.perf_counter() - t:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
        positions = next(iter(rrows.values()))["positions"]
        return {"model": name, "positions": positions, "add_bos": False, "recap": rrows, "llama": {}}
    ckpt = hub_checkpoint(MODELS[name], (args.build_dir / "ppl" / MODELS[name].name).resolve())
    stem = f"{ckpt.name}-{checkpoint_digest(ckpt)}"
    files = {g: ckpt.parent / f"{stem}-{g}.gguf" for g in GGUF_TYPES}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise SystemExit(f"missing GGUFs (run benchmarks/perplexity_peers.py first): {missing}")
    check = token_check(tok, llama, files["f32"], args.data)
    bos = tok.bos_token_id if gguf_add_bos(llama, files["f32"]) else None
    windows = llama_cpp_windows(ids, args.ctx, bos, args.chunks or None)
    base = args.work_dir / f"{name}-f32.kld"
    lrows = llama_kl(llama, files, args.data, args, base)
    positions = base_file_check(base, windows, bos, args.ctx)
    print(f"{name}: {check['tokens']} tokens, equal ids; llama.cpp's base file holds recap's {len(windows)} chunks "
          f"and {positions} positions; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    t = time.perf_counter()
    rrows = recap_kl(MODELS[name], windows, score_from, llama_base_logprobs(base), args.formats)
    base.unlink()  # 130 MB at an 8k vocabulary
    print(f"  recap: {time.perf_counter() - t:.0f} s", flush=True)
    if any(r["positions"] != positions for r in rrows.values()):
        raise SystemExit("recap scored other positions than llama.cpp")
    return {"model": name, "positions": positions, "add_bos": bos is not None, "recap": rrows, "llama": lrows}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| model | engine | format | mean KL(fp32 \\|\\| format) | 99th pct KL | top-1 agreement | perplexity |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for engine, fmts in (("recap", r["recap"]), ("llama.cpp", r["llama"])):
            for fmt, s in fmts.items():
                print(f"| {r['model']} | {engine} | {fmt} | {s['mean_kl']:.6f} ± {s['mean_kl_pm']:.6f} "
                      f"| {s['kl_p99']:.6f} | {100 * s['top1_agreement']:.2f}% | {s['perplexity']:.2f} |")  # fmt: skip
    paired = [(r["model"], f, st["paired"]) for r in rows for f, st in r["recap"].items() if "paired" in st]
    if paired:
        print("\n| model | format | against | mean KL difference, paired (± s.e. over chunks) | "
              "NLL per token difference (ln perplexity ratio) |\n| --- | --- | --- | --- | --- |")  # fmt: skip
        for model, f, p in paired:
            print(f"| {model} | {f} | {p['vs']} | {p['dkl']:+.6f} ± {p['dkl_se']:.6f} | {p['dnll']:+.5f} ± "
                  f"{p['dnll_se']:.5f} |")  # fmt: skip
    if not rows[0]["llama"]:  # --recap-only
        print(f"\n{rows[0]['positions']} positions per model (each chunk's second half, llama.cpp's chunks)")
        return
    print(f"\nboth engines on the same {rows[0]['positions']} positions per model (each chunk's second half, "
          "checked against llama.cpp's base file); llama.cpp's base holds 16-bit log-probs, so its f32 row is "
          "that file's floor, recap's fp32 row is exactly 0")  # fmt: skip


def main() -> None:
    ap = heldout_parser(__doc__)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp"), help="where llama.cpp's base logits go")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "kl_divergence.json")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                    help="recap's formats to compare with fp32 (default: all)")  # fmt: skip
    ap.add_argument("--recap-only", action="store_true", help="recap's rows only: no llama.cpp, no GGUFs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llama = None if args.recap_only else ensure_llama(args.build_dir, TARGETS)  # perplexity_peers.py built it
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [model_row(name, llama, args) for name in args.models]
    print(f"{start}, load {os.getloadavg()}")
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"start": start, "argv": sys.argv, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
