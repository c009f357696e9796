"""`recap bench WORKLOAD`: run a workload under several configurations side by side.

    recap bench multiturn                       # off, align, all, recap, transformers; default model
    recap bench sysprompt --toy --out /tmp/b    # smoke-size run
    recap bench insert --configs off,recap --threads 1
    recap bench multiturn --url off=http://127.0.0.1:8001 --url recap=http://127.0.0.1:8002
    recap bench throughput --num-seqs 16 --max-len 256
    recap bench ckpt-overhead --prompt-tokens 2048 --repeats 7
    recap bench replay --trace T.jsonl --kv-unbounded --state-checkpoints 512

Each configuration gets its own engine, all built (and warmed up) in this run before any request;
then the configurations run the workload in lockstep, taking turns request by request (`serial`) or
wave by wave (`wave`), so that load drift on a shared machine falls on all of them alike. The
requests are identical for all (seeded recipes; multi-turn answers are each configuration's own).
Writes WORKLOAD.json and PNG plots into --out and prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recap.bench.workloads import RECIPES, Recipe

DEFAULT_CONFIGS = {
    "multiturn": "off,align,all,recap,hf",
    "sysprompt": "off,align,all,recap,recap-noseg,hf",
    "insert": "off,align,all,recap,hf",
    "repetition": "off,align,all,recap",
    "throughput": "off,recap",
}
DEFAULT_SUBMIT = {"throughput": "wave"}  # others: serial
# transformers re-runs every prompt in full: by default it runs the first N sessions only (its TTFT
# depends only on the prompt length, and ratios are taken over the requests both ran).
DEFAULT_HF_SESSIONS = {"multiturn": 2, "sysprompt": 4, "insert": 2}
STEP_NAMES = {"multiturn": "turn", "insert": "step", "sysprompt": "request"}
SKIP_FIELDS = {"seed", "temperature"}


def _size_flags(p: argparse.ArgumentParser, cls: type[Recipe]) -> None:
    g = p.add_argument_group("sizes")
    for f in dataclasses.fields(cls):
        if f.name not in SKIP_FIELDS:
            g.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=int,
                default=None,
                help=f"default {f.default} (--toy: {cls.toy.get(f.name, f.default)})",
            )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    from recap.units import positive_bytes

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="model folder (default: the random-weight hybrid)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument(
        "--kv-cache-bytes",
        type=positive_bytes,
        default=positive_bytes("256MiB"),
        help="KV block pool per engine, default 256MiB (all engines live at once)",
    )
    g.add_argument(
        "--state-cache-bytes",
        type=positive_bytes,
        default=positive_bytes("1GiB"),
        help="state pool (running slots + checkpoints), default 2GiB",
    )
    g.add_argument("--cache-dir", default=None, help="config recap-disk: its disk tier goes under DIR/recap-disk")
    g.add_argument("--cache-host-bytes", type=positive_bytes, default=positive_bytes("1GiB"),
                   help="config recap-host: its host-memory tier's budget (default 1GiB)")
    g.add_argument("--cache-disk-bytes", type=positive_bytes, default=None,
                   help="config recap-disk: its disk tier's budget (default 16GiB)")


def _workload_parser(sub: Any, name: str, cls: type[Recipe]) -> None:
    p = sub.add_parser(name, help=cls.summary, description=cls.__doc__)
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS[name],
        help="comma-separated: off, align, all, recap, recap-noseg, recap-host, recap-disk, hf (default %(default)s)",
    )
    p.add_argument(
        "--submit",
        choices=("serial", "wave"),
        default=DEFAULT_SUBMIT.get(name, "serial"),
        help="serial: one request at a time; wave: a wave's requests together (default %(default)s)",
    )
    p.add_argument(
        "--url",
        action="append",
        default=None,
        metavar="[NAME=]URL",
        help="run against running servers instead (repeatable; NAME=URL names the column)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="--url with --submit wave: requests in flight")
    p.add_argument("--no-segments", action="store_true", help="--url: do not send segment boundaries")
    p.add_argument(
        "--hf-sessions",
        type=int,
        default=DEFAULT_HF_SESSIONS.get(name),
        help="transformers runs only sessions < N (default %(default)s; 0: all)",
    )
    p.add_argument("--toy", action="store_true", help="smoke-test sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--no-plots", action="store_true")
    _size_flags(p, cls)
    _engine_flags(p)
    p.set_defaults(func=run_workload, workload=name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recap bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    for name, cls in RECIPES.items():
        _workload_parser(sub, name, cls)
    c = sub.add_parser("ckpt-overhead", help="prefill cost of a checkpoint at every block boundary (all vs none)")
    c.add_argument("--prompt-tokens", type=int, default=2048)
    c.add_argument("--repeats", type=int, default=7)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", type=Path, default=Path("bench_out"))
    _engine_flags(c)
    c.set_defaults(func=run_ckpt_overhead)
    from recap.bench.replay import add_bench_replay_parser

    add_bench_replay_parser(sub)
    return parser


def build_recipe(args: argparse.Namespace) -> Recipe:
    cls = RECIPES[args.workload]
    sizes: dict[str, Any] = dict(cls.toy) if args.toy else {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if f.name not in SKIP_FIELDS and v is not None:
            if v <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive")
            sizes[f.name] = v
    return cls(seed=args.seed, **sizes)


def environment(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "argv": sys.argv[1:],
    }


def _engine_options(args: argparse.Namespace, model: str) -> Any:
    from recap.bench.runners import EngineOptions

    return EngineOptions(
        model=model,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        state_cache_bytes=args.state_cache_bytes,
        threads=args.threads,
        seed=args.seed,
        cache_dir=getattr(args, "cache_dir", None),
        cache_host_bytes=getattr(args, "cache_host_bytes", None),
        cache_disk_bytes=getattr(args, "cache_disk_bytes", None),
    )


def _resolve_model(args: argparse.Namespace) -> tuple[str, Any, int]:
    """Model folder, tokenizer, and the vocabulary the recipes may draw from."""
    from recap.model.loader import load_tokenizer

    model = args.model
    if model is None:
        from recap.model.default_model import ensure_random_model

        model = str(ensure_random_model())
    tok = load_tokenizer(args.tokenizer or model)
    cfg = Path(model) / "config.json"
    vocab = json.loads(cfg.read_text()).get("vocab_size", len(tok)) if cfg.is_file() else len(tok)
    return model, tok, min(int(vocab), len(tok))


def _specs(args: argparse.Namespace) -> list[Any]:
    from recap.bench.runners import CONFIGS, ConfigSpec

    if args.url:
        specs = []
        for i, item in enumerate(args.url):
            name, _, url = item.partition("=") if "=" in item.split("://")[0] else ("", "", item)
            specs.append(
                ConfigSpec(
                    name or (f"server{i}" if len(args.url) > 1 else "server"),
                    "url",
                    segments=not args.no_segments,
                    url=url,
                    description=url,
                )
            )
        return specs
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"unknown config {unknown}; choose from {sorted(CONFIGS)}")
    return [CONFIGS[n] for n in names]


def _build_runners(
    args: argparse.Namespace, specs: list[Any], model: str, tok: Any, opts: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Runners (built and warmed up), request filters and submission modes, per configuration."""
    from recap.bench.hf_baseline import HFRunner
    from recap.bench.runners import EngineRunner, UrlRunner

    runners: dict[str, Any] = {}
    keep: dict[str, Any] = {}
    submit: dict[str, str] = {}
    try:
        for spec in specs:
            submit[spec.name] = args.submit
            if spec.kind == "hf":
                runners[spec.name] = HFRunner(spec, model, args.threads, pad_token_id=tok.pad_token_id or 0)
                submit[spec.name] = "serial"
                if args.hf_sessions:
                    keep[spec.name] = lambda r, n=args.hf_sessions: r.session < n
            elif spec.kind == "url":
                encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
                runners[spec.name] = UrlRunner(spec, args.concurrency, encode)
            else:
                runners[spec.name] = EngineRunner(spec, opts)
            runners[spec.name].warmup()
    except BaseException:
        for runner in runners.values():
            runner.close()
        raise
    return runners, keep, submit


def run_workload(args: argparse.Namespace) -> int:
    import torch

    from recap.bench import highlights, plots, results
    from recap.bench.runners import drive
    from recap.bench.workloads import TokenSpace

    torch.set_num_threads(args.threads)
    recipe = build_recipe(args)
    specs = _specs(args)
    model, tok, vocab = _resolve_model(args)
    space = TokenSpace.from_tokenizer(tok, vocab)
    opts = _engine_options(args, model)
    print(f"{recipe.name}: {recipe}; submit={args.submit}; threads={args.threads}; model={model}", flush=True)
    # Every engine is built (and warmed up) before any request runs; then they run in lockstep.
    runners, keep, submit = _build_runners(args, specs, model, tok, opts)
    try:
        total = sum(1 for w in recipe.waves(space, {}) for r in w for n in runners if keep.get(n) is None or keep[n](r))
        runs = drive(recipe, space, runners, submit, keep, total)
    finally:
        for runner in runners.values():
            runner.close()
    summaries = {n: results.summarize(r, args.block_size) for n, r in runs.items()}
    results.add_ratios(summaries, runs, "off")
    found, lines = highlights.HIGHLIGHTS[recipe.name](runs, recipe, space, args.block_size)
    step = STEP_NAMES.get(recipe.name)
    print("\n" + results.main_table(summaries))
    if step:
        print("\n" + results.step_table(summaries, step))
    if lines:
        print("\n" + "\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": recipe.name,
        "recipe": dataclasses.asdict(recipe),
        "submit": args.submit,
        "engine": dataclasses.asdict(opts),
        "environment": environment(args.threads),
        "configs": summaries,
        "highlights": found,
    }
    path = args.out / f"{recipe.name}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    written = [path] if args.no_plots else [path, *plots.write_plots(summaries, args.out, recipe.name, step)]
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def run_ckpt_overhead(args: argparse.Namespace) -> int:
    import torch

    from recap.bench.ckpt_overhead import overhead_table
    from recap.bench.ckpt_overhead import run_ckpt_overhead as run

    torch.set_num_threads(args.threads)
    model, _, vocab = _resolve_model(args)
    res = run(_engine_options(args, model), args.prompt_tokens, args.repeats, vocab, args.seed)
    print("\n" + overhead_table(res))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ckpt-overhead.json"
    path.write_text(
        json.dumps({"workload": "ckpt-overhead", **res, "environment": environment(args.threads)}, indent=2) + "\n"
    )
    print(f"\nwrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
