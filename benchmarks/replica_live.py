"""Live replicas on a local Ray cluster: token hit rate and TTFT per router, on multi-turn and
shared-system-prompt sessions (docs/distributed.md).

For each workload and router a fresh deployment (cold caches) of --replicas replicas behind the ingress
serves --sessions concurrent sessions (at most --concurrency requests in flight), each a chain of turns
sent one after another, streamed, greedy. Routers:
  checkpoint:  recap's checkpoint-aware router (--queued-request-tokens);
  round_robin: recap's router cycling through the replicas;
  pow2:        Ray Serve's default router (two replicas at random, the shorter queue);
  single:      one replica (the reference: one cache holding everything).
Workloads (text prompts from a seeded random vocabulary of made-up words):
  multi_turn:    each session its own history; turn t+1's prompt = turn t's prompt + its completion + a new
                 question (what a decode-end checkpoint covers);
  shared_system: one system prompt shared by every session; each turn is that prompt + a new question.
Hit rate = sum of usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens; TTFT = time to the first
streamed content chunk, at the client.

    python benchmarks/replica_live.py --replicas 4 --sessions 64 --tiny /tmp/tiny --json-out live.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from recap.cluster.deploy import ClusterConfig, LocalClusterConfig, build_cluster_app, init_ray, resolve_model
from recap.engine.config import EngineConfig
from recap.launch.settings import ServerSettings

ROUTERS = ("checkpoint", "round_robin", "pow2", "single")
WORKLOADS = ("multi_turn", "shared_system")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    sessions: int
    turns: int
    history_words: int  # multi_turn: each session's own opening; shared_system: the shared system prompt
    question_words: int
    max_tokens: int
    seed: int = 0


def _words(rng: random.Random, vocab: list[str], n: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(n))


def _vocab(seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(2000)]


async def run_session(client: httpx.AsyncClient, w: Workload, s: int, sem: asyncio.Semaphore, model: str,
                      out: list[dict[str, Any]]) -> None:
    vocab = _vocab(w.seed)
    rng = random.Random(w.seed * 1000 + s + 1)
    if w.name == "shared_system":
        system = _words(random.Random(w.seed), vocab, w.history_words)
        prompt = ""
    else:
        system = ""
        prompt = f"Session {s}. " + _words(rng, vocab, w.history_words)
    for turn in range(w.turns):
        question = f" Question {turn}: " + _words(rng, vocab, w.question_words) + "?"
        text = (system + question) if w.name == "shared_system" else (prompt + question)
        body = {"model": model, "prompt": text, "max_tokens": w.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with sem:
            t0 = time.perf_counter()
            ttft, completion, usage, replica = None, "", None, None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
                replica = r.headers.get("x-recap-replica")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        completion += event["choices"][0].get("text", "")
                    if event.get("usage"):
                        usage = event["usage"]
        assert usage is not None and ttft is not None
        out.append({"session": s, "turn": turn, "ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "replica": replica})
        prompt = text + completion


async def run_workload(url: str, w: Workload, concurrency: int, model: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(run_session(client, w, s, sem, model, out) for s in range(w.sessions)))
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(r["ttft_s"] for r in rows)
    by_replica: dict[str, int] = {}
    homes: dict[int, set[str]] = {}
    for r in rows:
        by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
        homes.setdefault(r["session"], set()).add(r["replica"])
    return {
        "requests": len(rows),
        "token_hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": ttfts[len(ttfts) // 2],
        "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "max_share": max(by_replica.values()) / len(rows),
        "mean_replicas_per_session": statistics.fmean(len(h) for h in homes.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded default hybrid)")
    p.add_argument("--tiny", type=Path, default=None, metavar="DIR",
                   help="build the tests' tiny random Bamba in DIR and serve it (fast: hit rates and routing overhead)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (all replicas)")
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-words", type=int, default=200)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--question-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--queued-request-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the workload's words and questions")
    p.add_argument("--cpus", type=int, default=None, help="the local cluster's CPUs (default: replicas + 1)")
    p.add_argument("--port", type=int, default=18210)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    model_dir = args.model
    if args.tiny is not None:
        from tests.engine.conftest import tiny_model_dir

        model_dir = str(tiny_model_dir(args.tiny, "bamba"))
    config = resolve_model(EngineConfig(model=model_dir, num_threads=1))
    init_ray(None, LocalClusterConfig(num_cpus=args.cpus or args.replicas + 1, object_store_bytes=256 << 20))
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    model = Path(str(config.model)).name
    results = []
    print(f"load average {os.getloadavg()[0]:.1f}; {args.replicas} replicas, {args.sessions} sessions, "
          f"concurrency {args.concurrency}")
    print(f"{'workload':>14} {'router':>12} {'hit rate':>9} {'mean TTFT':>10} {'p50 TTFT':>9} {'p90 TTFT':>9} "
          f"{'max share':>9} {'replicas/session':>16}")
    try:
        for name in args.workloads:
            words = args.system_words if name == "shared_system" else args.history_words
            w = Workload(name, args.sessions, args.turns, words, args.question_words, args.max_tokens, args.seed)
            for router in args.routers:
                num = 1 if router == "single" else args.replicas
                cluster = ClusterConfig(num_replicas=num, policy="checkpoint" if router == "single" else router,
                                        queued_request_tokens=args.queued_request_tokens, stats_period_s=0.5)
                app = build_cluster_app(dataclasses.replace(config, served_model_name=model), cluster, ServerSettings())
                serve.run(app, name="recap", route_prefix="/")
                t0 = time.perf_counter()
                rows = asyncio.run(run_workload(url, w, args.concurrency, model))
                row = {"workload": name, "router": router, "replicas": num, "wall_s": time.perf_counter() - t0,
                       "load_avg_1m": os.getloadavg()[0], **summarize(rows)}
                results.append(row)
                print(f"{name:>14} {router:>12} {row['token_hit_rate']:>8.1%} {row['mean_ttft_s']:>9.3f}s "
                      f"{row['p50_ttft_s']:>8.3f}s {row['p90_ttft_s']:>8.3f}s {row['max_share']:>8.1%} "
                      f"{row['mean_replicas_per_session']:>16.2f}", flush=True)
                serve.delete("recap")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"args": vars(args) | {"json_out": str(args.json_out)},
                                             "rows": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
