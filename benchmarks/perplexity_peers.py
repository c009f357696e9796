"""Held-out perplexity of the trained default models through recap and llama.cpp, one table, one command.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/perplexity_peers.py --data /tmp/recap-train/heldout.txt \\
        [--ctx 512] [--chunks 32] [--threads 1] [--build-dir build/peers] [--out bench_out/perplexity_peers.json]

The held-out file is the one tools/train_default_model.py writes (OUT/heldout.txt). For each shipped model
(recap/model/weights/default and default-draft):
- the checkpoint is copied to --build-dir with its config.json in the hub's NemotronH form (see hub_config),
  converted with llama.cpp's own convert_hf_to_gguf.py to GGUF f32, bf16 and q8_0, and f32 -> Q4_K_M with
  llama-quantize; the tokenizer goes in as llama.cpp's "gpt-2" pre-tokenizer (see _CONVERT);
- the text's token ids through llama-tokenize on the GGUF are compared with transformers' (must be equal);
- llama-perplexity -c CTX --chunks CHUNKS -b CTX -t THREADS on each GGUF, and recap on the same chunks and
  scored tokens (recap/bench/perplexity.py's llama-cpp protocol) in fp32, bf16, int8 and int4, beside recap's
  own protocol (BOS + CTX tokens, every token scored) over the same CHUNKS x CTX tokens.
Perplexity is deterministic: no rounds; the load average is printed beside the run.

With --imatrix-calibration FILE (text apart from --data: never calibrate on scored text), both engines also take
an importance matrix from FILE (CTX-token chunks, every chunk): llama-imatrix on the f32 GGUF then llama-quantize
--imatrix to Q4_K_M ("Q4_K_M+imatrix"), and recap's `recap imatrix` statistics (model/activation_stats.py) for
int4 and int4_k with --quantization-imatrix ("int4+imatrix", "int4_k+imatrix"); a second table pairs every recap
4-bit format with both Q4_K_M files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_llama import LlamaCpp, ensure_llama, run_logged  # noqa: E402

from recap.bench.perplexity import chunk_nll, llama_cpp_score_from, paired_log_ratio  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"main": ROOT / "recap/model/weights/default", "draft": ROOT / "recap/model/weights/default-draft"}
TARGETS = ("llama-perplexity", "llama-quantize", "llama-tokenize")
IMATRIX_TARGETS = (*TARGETS, "llama-imatrix")
CONVERTER_PINS = ("transformers==4.57.6", "tokenizers==0.22.1", "huggingface_hub==0.36.0")
# recap format -> the GGUF it is compared with
PAIRS = (("float32", None, "f32"), ("bfloat16", None, "bf16"), ("float32", "int8", "q8_0"),
         ("float32", "int4", "Q4_K_M"), ("float32", "int4_k", "Q4_K_M"))  # fmt: skip  int4_k: int4 super-blocks
IMATRIX = "+imatrix"  # a format fitted with the calibration text's importance matrix
IMATRIX_PAIRS = (("float32", "int4" + IMATRIX, "Q4_K_M" + IMATRIX), ("float32", "int4_k" + IMATRIX, "Q4_K_M" + IMATRIX))


def pair_name(dtype: str, quant: str | None) -> str:
    """--pairs' name of a recap format: fp32, bf16 or its quantization."""
    return quant or {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def chosen_pairs(args: argparse.Namespace) -> tuple[tuple[str, str | None, str], ...]:
    pairs = PAIRS + (IMATRIX_PAIRS if getattr(args, "imatrix_calibration", None) else ())
    return tuple(p for p in pairs if args.pairs is None or pair_name(p[0], p[1]).removesuffix(IMATRIX) in args.pairs)
# transformers 5 writes NemotronH's block kinds as a list of these names; the hub's configs (and llama.cpp's
# converter) use the one-character hybrid_override_pattern
_PATTERN = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
# keys transformers 5 writes with MoE defaults into every NemotronH config; their presence (num_experts_per_tok)
# makes the converter pick the nemotron_h_moe architecture, and the dense model's MLP blocks then convert with
# no feed-forward width. The shipped models are dense: none of these is used.
_MOE_KEYS = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
             "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "moe_latent_size",
             "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "mtp_layers_block_type",
             "num_nextn_predict_layers")  # fmt: skip

# convert_hf_to_gguf.py with the BPE pre-tokenizer named: it identifies a pre-tokenizer by hashing the ids of a
# probe string, and a newly trained vocabulary hashes to no known model. The shipped tokenizer.json has no
# normalizer and the ByteLevel pre-tokenizer with the GPT-2 split regex (use_regex, no prefix space), which is
# what llama.cpp's "gpt-2" pre-type implements; any other tokenizer falls through to the converter's own check.
_CONVERT = """
import json, runpy, sys
src = sys.argv.pop(1)
sys.path[0] = src
sys.path.insert(1, src + "/gguf-py")
from conversion import base

def get_vocab_base_pre(self, tokenizer):
    tj = json.loads((self.dir_model / "tokenizer.json").read_text())
    pre = tj.get("pre_tokenizer") or {}
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    return "gpt-2" if tj.get("normalizer") is None and gpt2 else original(self, tokenizer)

original = base.TextModel.get_vocab_base_pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def hub_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The shipped config in the hub's dense NemotronH form: the block pattern as hybrid_override_pattern,
    the unused MoE defaults dropped. Every other key (and every weight) is unchanged."""
    out = {k: v for k, v in cfg.items() if k not in _MOE_KEYS}
    out["hybrid_override_pattern"] = "".join(_PATTERN[t] for t in cfg["layers_block_type"])
    return out


def hub_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of src that the converter reads: hub_config, and tokenizer_config's transformers-5 class name
    (TokenizersBackend) as transformers 4's PreTrainedTokenizerFast (the same tokenizer.json)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "tokenizer_config.json"):
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(hub_config(cfg), indent=2))
    tok = json.loads((src / "tokenizer_config.json").read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return dst


def ensure_converter_deps(site: Path) -> Path:
    """The transformers the converter pins (requirements-convert_hf_to_gguf.txt: 4.57.6), installed with
    --target into `site` (put first on its PYTHONPATH; torch, numpy and safetensors come from this venv).
    With transformers 5, AutoConfig re-adds NemotronH's MoE defaults to every config, and the converter then
    writes the dense model as nemotron_h_moe; 4.57.6 does not know nemotron_h, so the converter reads
    config.json as written."""
    if not (site / "transformers").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), *CONVERTER_PINS],
                       check=True)  # fmt: skip
    return site


def _run(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def checkpoint_digest(ckpt: Path) -> str:
    """A short digest of the files a conversion reads, so a retrained checkpoint never meets a stale GGUF."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        h.update((ckpt / name).read_bytes())
    return h.hexdigest()[:12]


def ggufs(llama: LlamaCpp, ckpt: Path, out_dir: Path, site: Path) -> dict[str, Path]:
    """f32, bf16 and q8_0 from the converter, Q4_K_M from f32 by llama-quantize; each cached under the
    checkpoint's digest."""
    out: dict[str, Path] = {}
    env = {**os.environ, "PYTHONPATH": str(site)}
    stem = f"{ckpt.name}-{checkpoint_digest(ckpt)}"
    for t in ("f32", "bf16", "q8_0"):
        out[t] = out_dir / f"{stem}-{t}.gguf"
        if not out[t].is_file():
            tmp = out[t].with_suffix(".tmp")
            cmd = [sys.executable, "-c", _CONVERT, str(llama.src), str(ckpt), "--outtype", t, "--outfile", str(tmp)]
            _run(cmd, out_dir / "convert.log", cwd=llama.src, env=env)
            tmp.rename(out[t])
    out["Q4_K_M"] = out_dir / f"{stem}-Q4_K_M.gguf"
    if not out["Q4_K_M"].is_file():
        tmp = out["Q4_K_M"].with_suffix(".tmp")
        _run([str(llama.tool("llama-quantize")), str(out["f32"]), str(tmp), "Q4_K_M", "1"], out_dir / "quantize.log")
        tmp.rename(out["Q4_K_M"])
    return out


def imatrix_ggufs(llama: LlamaCpp, f32: Path, calibration: Path, args: argparse.Namespace) -> dict[str, Path]:
    """llama-imatrix over the calibration text (CTX-token chunks, all of them), then llama-quantize --imatrix to
    Q4_K_M: {"Q4_K_M+imatrix": the GGUF}. Made anew each run (seconds for the shipped models)."""
    imatrix = f32.with_name(f32.stem.removesuffix("-f32") + "-imatrix.gguf")
    _run([str(llama.tool("llama-imatrix")), "-m", str(f32), "-f", str(calibration), "-c", str(args.ctx), "-b",
          str(args.ctx), "-t", str(args.threads), "--no-escape", "--no-ppl", "-o", str(imatrix)],
         f32.parent / "imatrix.log")  # fmt: skip
    out = f32.with_name(f32.stem.removesuffix("-f32") + "-Q4_K_M-imatrix.gguf")
    _run([str(llama.tool("llama-quantize")), "--imatrix", str(imatrix), str(f32), str(out), "Q4_K_M", "1"],
         f32.parent / "quantize.log")  # fmt: skip
    return {"Q4_K_M" + IMATRIX: out}


def recap_imatrix(model: Path, calibration: Path, out: Path, ctx: int) -> Path:
    """recap's importance matrix of `model` over the calibration text (`recap imatrix` MODEL --ctx CTX)."""
    import torch

    from recap.model import activation_stats
    from recap.model.loader import load_model, load_tokenizer

    loaded = load_model(model, torch.float32, linear_backend="torch")
    ids = load_tokenizer(loaded.path)(calibration.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    stats = activation_stats.collect(loaded.model, activation_stats.token_chunks(ids, ctx))
    print(f"  recap imatrix: {len(stats.means())} layers over {stats.tokens} tokens", flush=True)
    return activation_stats.save(stats, out, ctx)


def llama_ids(llama: LlamaCpp, gguf: Path, data: Path) -> list[int]:
    """The file's token ids through llama.cpp's tokenizer (no BOS). Its tools read -f text as a C string with
    escapes by default (a literal backslash-n in the text became a newline); --no-escape reads it as written."""
    res = subprocess.run([str(llama.tool("llama-tokenize")), "-m", str(gguf), "-f", str(data), "--ids", "--no-bos",
                          "--log-disable", "--no-escape"], check=True, capture_output=True, text=True)  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def llama_perplexity(llama: LlamaCpp, gguf: Path, data: Path, ctx: int, chunks: int | None, threads: int
                     ) -> dict[str, Any]:  # fmt: skip
    cmd = [str(llama.tool("llama-perplexity")), "-m", str(gguf), "-f", str(data), "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(chunks or -1), "-t", str(threads), "--no-escape"]  # fmt: skip
    final = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
    log = run_logged(cmd, gguf.with_suffix(f".ppl-c{ctx}.log"), final)
    m = final.search(log)
    assert m is not None
    n = re.search(r"calculating perplexity over (\d+) chunks", log)
    running = [float(v) for v in re.findall(r"\[\d+\]([\d.]+)", log[: m.start()])]
    return {"ppl": float(m.group(1)), "pm": float(m.group(2)), "chunks": int(n.group(1)) if n else None,
            "chunk_nll": chunk_nll(running, ctx - llama_cpp_score_from(ctx))}  # fmt: skip



def gguf_add_bos(llama: LlamaCpp, gguf: Path) -> bool:
    """tokenizer.ggml.add_bos_token (absent: false, llama.cpp's default for a gpt2-type vocabulary)."""
    sys.path.insert(0, str(llama.src / "gguf-py"))
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.parts[field.data[0]][0]) if field is not None else False


def token_check(tokenizer: Any, llama: LlamaCpp, gguf: Path, data: Path) -> dict[str, Any]:
    """Both engines' ids of the whole file; the run stops if they differ."""
    ref = tokenizer(data.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    got = llama_ids(llama, gguf, data)
    first_diff = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if first_diff is not None or len(ref) != len(got):
        raise SystemExit(f"tokenizations differ: transformers {len(ref)} ids, llama.cpp {len(got)}, first "
                         f"difference at {first_diff}")  # fmt: skip
    return {"tokens": len(ref), "equal": True}


def recap_rows(model: Path, data: Path, args: argparse.Namespace, add_bos: bool, imatrix: Path | None = None
               ) -> dict[str, dict[str, float]]:  # fmt: skip
    """recap's perplexity in each format under llama.cpp's protocol and under its own (same text tokens)."""
    from recap.bench.perplexity import engine_perplexity, llama_cpp_windows, windows_of
    from recap.engine.llm import LLM

    text = data.read_text(encoding="utf-8")
    out = {}
    for dtype, quant, _ in chosen_pairs(args):
        fitted = quant is not None and quant.endswith(IMATRIX)
        llm = LLM(str(model), dtype=dtype, quantization=quant.removesuffix(IMATRIX) if quant else None,
                  quantization_imatrix=str(imatrix) if fitted else None, num_threads=args.threads,
                  max_model_len=args.ctx + 2, enable_prefix_caching=False)  # fmt: skip
        tok = llm.get_tokenizer()
        ids = tok(text, add_special_tokens=False)["input_ids"]  # equal to llama.cpp's (token_check)
        chunks = llama_cpp_windows(ids, args.ctx, tok.bos_token_id if add_bos else None, args.chunks or None)
        llama_proto = engine_perplexity(llm, chunks, llama_cpp_score_from(args.ctx))
        own = engine_perplexity(llm, windows_of(tok, text, args.ctx, args.chunks * args.ctx if args.chunks else None))
        llm.close()
        key = f"{dtype} {quant or ''}".strip()
        out[key] = {"llama_protocol": llama_proto.perplexity, "llama_protocol_tokens": llama_proto.scored_tokens,
                    "own": own.perplexity, "own_tokens": own.scored_tokens,
                    "chunk_nll": list(llama_proto.window_nll)}  # fmt: skip
        print(f"  recap {key}: {out[key]['llama_protocol']:.3f} ({len(chunks)} chunks), own {own.perplexity:.3f}",
              flush=True)  # fmt: skip
    return out


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n| model | format (recap / llama.cpp) | recap, llama.cpp's chunks | llama.cpp | recap / llama.cpp "
          "| ln(recap / llama.cpp), paired over chunks | recap, its own windows |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for dtype, quant, gtype in chosen_pairs(args):
            rc = r["recap"][f"{dtype} {quant or ''}".strip()]
            lc = r["llama"][gtype]
            fmt = f"{quant or {'float32': 'fp32', 'bfloat16': 'bf16'}[dtype]} / {gtype}"
            d, se = rc["paired_vs_llama"]
            print(f"| {r['model']} | {fmt} | {rc['llama_protocol']:.2f} | {lc['ppl']:.2f} +/- {lc['pm']:.2f} "
                  f"| {rc['llama_protocol'] / lc['ppl']:.4f} | {d:+.5f} +/- {se:.5f} | {rc['own']:.2f} |")  # fmt: skip
    first = next(iter(rows[0]["recap"].values()))
    print(f"\nllama.cpp's chunks: {len(first['chunk_nll'])} x {args.ctx} tokens, {first['llama_protocol_tokens']}"
          f" scored; recap's own windows: BOS + {args.ctx} tokens, {first['own_tokens']} scored")


def print_cross_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Every recap 4-bit format against each llama.cpp Q4_K_M file run, paired over the same chunks."""
    print("\n| model | recap | llama.cpp | ln(recap / llama.cpp), paired over chunks |\n| --- | --- | --- | --- |")
    for r in rows:
        for key, rc in r["recap"].items():
            if "int4" not in key:
                continue
            for gtype, lc in r["llama"].items():
                if gtype.startswith("Q4_K_M"):
                    d, se = paired_log_ratio(rc["chunk_nll"], lc["chunk_nll"], [rc["llama_protocol_tokens"] //
                                             len(rc["chunk_nll"])] * len(rc["chunk_nll"]))  # fmt: skip
                    print(f"| {r['model']} | {key.removeprefix('float32 ')} | {gtype} | {d:+.5f} +/- {se:.5f} |")


def heldout_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line of the scripts that score the trained models' held-out text through both engines."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="held-out text (tools/train_default_model.py's)")
    ap.add_argument("--ctx", type=int, default=512, help="window / llama-perplexity -c")
    ap.add_argument("--chunks", type=int, default=32,
                    help="llama-perplexity --chunks (ctx x chunks tokens; 0: the whole file)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--build-dir", type=Path, default=Path("build") / "peers")
    return ap


def main() -> None:
    ap = heldout_parser(__doc__)
    ap.add_argument("--converter-site", type=Path, default=Path("build") / "peers" / "convert-site")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "perplexity_peers.json")
    ap.add_argument("--pairs", nargs="+", default=None, choices=[pair_name(d, q) for d, q, _ in PAIRS],
                    help="recap formats to score, each with its llama.cpp format (default: all)")
    ap.add_argument("--imatrix-calibration", type=Path, default=None,
                    help="calibration text (apart from --data) for both engines' importance matrices")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    llama = ensure_llama(args.build_dir, IMATRIX_TARGETS if args.imatrix_calibration else TARGETS)
    site = ensure_converter_deps(args.converter_site.resolve())
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for name in args.models:
        ckpt = hub_checkpoint(MODELS[name], (args.build_dir / "ppl" / MODELS[name].name).resolve())
        files = ggufs(llama, ckpt, ckpt.parent, site)
        imatrix = None
        if args.imatrix_calibration:
            files |= imatrix_ggufs(llama, files["f32"], args.imatrix_calibration, args)
            imatrix = recap_imatrix(MODELS[name], args.imatrix_calibration, ckpt.parent / "recap-imatrix.safetensors",
                                    args.ctx)  # fmt: skip
        check = token_check(AutoTokenizer.from_pretrained(str(MODELS[name])), llama, files["f32"], args.data)
        add_bos = gguf_add_bos(llama, files["f32"])
        print(f"{name}: {check['tokens']} tokens, equal ids in both engines; GGUF add_bos {add_bos}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        wanted = {g for _, _, g in chosen_pairs(args)}
        lrows = {g: llama_perplexity(llama, f, args.data, args.ctx, args.chunks, args.threads)
                 for g, f in files.items() if g in wanted}  # fmt: skip
        print("  llama.cpp: " + ", ".join(f"{g} {r['ppl']} ({r['chunks']} chunks)" for g, r in lrows.items()),
              flush=True)  # fmt: skip
        rrows = recap_rows(MODELS[name], args.data, args, add_bos, imatrix)
        for dtype, quant, gtype in chosen_pairs(args):  # the same chunks in both engines: compared chunk by chunk
            rc, lc = rrows[f"{dtype} {quant or ''}".strip()], lrows[gtype]
            tokens = [rc["llama_protocol_tokens"] // len(rc["chunk_nll"])] * len(rc["chunk_nll"])
            rc["paired_vs_llama"] = paired_log_ratio(rc["chunk_nll"], lc["chunk_nll"], tokens)
        rows.append({"model": name, "tokens": check, "add_bos": add_bos, "llama": lrows, "recap": rrows,
                     "gguf_bytes": {g: f.stat().st_size for g, f in files.items()}})  # fmt: skip
    print(f"{start}, load {os.getloadavg()}")
    print_table(rows, args)
    if args.imatrix_calibration:
        print_cross_table(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"start": start, "argv": sys.argv, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
