"""The `recap` command: `serve` (OpenAI-compatible server), `proxy` (prefill/decode disaggregation),
`generate` (one-off), `eval` (perplexity of a text file), `imatrix` (an importance matrix for int4), `bench`
(studies)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from recap.disagg.config import add_proxy_args
from recap.launch.imatrix import add_imatrix_args, run_imatrix
from recap.launch.serve import add_serve_args, serve


def _generate(args: argparse.Namespace) -> int:
    from recap import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, seed=args.seed, num_threads=args.num_threads)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except ValueError as e:  # InvalidRequestError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0


def _eval(argv: Sequence[str]) -> int:
    # bench's own module, loaded by name as `recap bench` is (the cli sits below bench in the import layers)
    return int(importlib.import_module("recap.bench.perplexity").main(list(argv)) or 0)


def _proxy(args: argparse.Namespace) -> int:
    from recap.disagg.proxy import run_proxy

    return run_proxy(args)


def _bench(argv: Sequence[str]) -> int:
    try:
        module = importlib.import_module("recap.bench.cli")
    except ModuleNotFoundError as e:
        if e.name != "recap.bench.cli":
            raise
        print("error: `recap bench` is not available in this build (recap.bench.cli is missing)", file=sys.stderr)
        return 2
    return int(module.main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(s)
    s.set_defaults(func=serve)
    x = sub.add_parser("proxy", help="route requests to a prefill and a decode instance (disaggregation)")
    add_proxy_args(x)
    x.set_defaults(func=_proxy)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--model", default=None, help="model folder or hub id (default: the trained default model)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message (chat template)")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.set_defaults(func=_generate)
    m = sub.add_parser("imatrix", help="an importance matrix for --quantization-imatrix (llama-imatrix's)")
    add_imatrix_args(m)
    m.set_defaults(func=run_imatrix)
    sub.add_parser("eval", help="perplexity of a text file (recap eval perplexity --help)", add_help=False)
    sub.add_parser("bench", help="workloads, tables and plots (recap bench --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":
        return _bench(args_list[1:])
    if args_list and args_list[0] == "eval":
        return _eval(args_list[1:])
    args = build_parser().parse_args(args_list)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
