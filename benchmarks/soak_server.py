"""Soak the HTTP server: many concurrent requests with random aborts, disconnects and bad requests,
then check, from the server's own endpoints:
  counts:    /metrics alone adds up: received == success + aborted + rejected (recap.http.request_counts),
             and received == sent, less the aborts whose client gave up before its request reached the server;
  leaks:     /debug/integrity clean, every KV block and state slot back in its pool, nothing running;
  records:   /debug/memory's per-request records (recap.process.census) all 0 at the end, bounded ones within
             capacity;
  memory:    resident memory, malloc's bytes in use and Python's allocated blocks, sampled from /debug/memory
             as it runs, flat after warm-up: slope per 1k requests (median pairwise, recap.bench.memory_trend).
             RSS includes memory malloc keeps free; a last sample after malloc_trim shows how much that is.
The documented full run is 10k requests (the default); the server needs --enable-debug-endpoints.

    .venv/bin/python benchmarks/soak_server.py                      # self-started server, tiny model
    .venv/bin/python benchmarks/soak_server.py --default-model      # self-started, embedded default model
    .venv/bin/python benchmarks/soak_server.py --url http://127.0.0.1:8000 --requests 2000

Bounded in count (--requests) and time (--time-limit); loopback servers only. Exit status 0 when every
check above holds. --json writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
from recap.bench.memory_trend import after_warmup, growth, slope_per_1k  # noqa: E402

MEMORY_SERIES = ("rss_bytes", "malloc_in_use_bytes", "python_blocks", "gc_objects")
MiB = 2**20
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WORDS = ("pump", "valve", "filter", "gauge", "schedule", "inspect", "log", "pressure", "seal", "bearing", "motor",
         "flow", "tank", "pipe", "sensor", "alarm", "reset", "manual", "check", "weekly")


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    aborts: int = 0
    rejected: int = 0  # deliberately bad requests answered with the expected 4xx
    errors: int = 0
    timed_out: int = 0  # plain requests the client gave up on (may never have reached the server)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(what[:300])


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _body(rng: random.Random, model: str | None, systems: list[str]) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if model:
        common["model"] = model
    if rng.random() < 0.5:
        messages = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": _text(rng, rng.randint(2, 30))}]
        return "/v1/chat/completions", {**common, "messages": messages}
    prompt: Any = _text(rng, rng.randint(2, 60))
    if rng.random() < 0.1:
        prompt = [prompt, _text(rng, 5)]
    return "/v1/completions", {**common, "prompt": prompt, "n": rng.choice([1, 1, 1, 2])}


def _bad_body(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{"prompt": "x", "max_tokens": -1}, {"prompt": [10**9]}, {"prompt": "x", "bogus": 1},
                       {"prompt": "x", "n": 1000}, {"prompt": ""}])


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], cut: int | None, t: Tally) -> None:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            t.error(f"{r.status_code} {(await r.aread()).decode(errors='replace')}")
            return
        events = 0
        last = ""
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            last = line
            if '"error"' in line:
                t.error(line)
                return
            if cut is not None and events >= cut:
                t.aborts += 1
                return  # leaving the block closes the connection mid-stream
        if last != "data: [DONE]":
            t.error(f"stream ended without [DONE]: {last!r}")
            return
        t.ok += 1


async def _plain(client: httpx.AsyncClient, path: str, body: dict[str, Any], deadline: float | None, t: Tally) -> None:
    try:
        r = await asyncio.wait_for(client.post(path, json=body), timeout=deadline)
    except TimeoutError:
        t.aborts += 1
        t.timed_out += 1  # the cancelled request closes its connection: the server aborts it
        return
    if r.status_code != 200:
        t.error(f"{r.status_code} {r.text}")
        return
    usage = r.json()["usage"]
    t.prompt_tokens += usage["prompt_tokens"]
    t.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    t.ok += 1


async def _one(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace, systems: list[str],
               t: Tally) -> None:
    if rng.random() < args.bad_fraction:
        r = await client.post("/v1/completions", json=_bad_body(rng))
        if r.status_code in (400, 404) and "error" in r.json():
            t.rejected += 1
        else:
            t.error(f"bad request got {r.status_code}: {r.text}")
        return
    path, body = _body(rng, args.model_name, systems)
    abort = rng.random() < args.abort_fraction
    try:
        if rng.random() < 0.5:
            await _stream(client, path, body, rng.randint(1, 4) if abort else None, t)
        else:
            await _plain(client, path, body, rng.uniform(0.005, 0.3) if abort else None, t)
    except httpx.HTTPError as e:
        t.error(f"{type(e).__name__}: {e}")


def _metrics(url: str) -> dict[str, float]:
    """recap:api_requests_* by outcome/reason, and the resident memory, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            if s.name.startswith("recap:api_requests") or s.name == "process_resident_memory_bytes":
                key = s.labels.get("outcome") or s.labels.get("reason") or ""
                out[f"{s.name}:{key}" if key else s.name] = s.value
    return out


def _memory(url: str, trim: bool = False) -> dict[str, Any]:
    params = {"collect": "true", **({"trim": "true"} if trim else {})}  # gc_objects: live objects only
    return httpx.get(f"{url}/debug/memory", params=params, timeout=60).json()


async def _soak(url: str, args: argparse.Namespace, memory: list[tuple[int, dict[str, Any]]]) -> tuple[Tally, float]:
    rng = random.Random(args.seed)
    systems = [f"System prompt {i}: " + _text(random.Random(i), 40) for i in range(8)]
    t = Tally()
    next_i = 0
    stop_at = time.monotonic() + args.time_limit
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_i
            while next_i < args.requests and time.monotonic() < stop_at:
                next_i += 1
                t.sent += 1
                if next_i % 1000 == 0:
                    print(f"  {next_i} requests sent", file=sys.stderr, flush=True)
                if next_i % args.memory_every == 0:
                    memory.append((next_i, await asyncio.to_thread(_memory, url)))
                await _one(client, random.Random(rng.random()), args, systems, t)

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return t, time.monotonic() - t0


def _leaks(url: str, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """Poll until nothing runs; count leaked blocks/slots (and a failed integrity check as a leak)."""
    deadline = time.monotonic() + timeout
    while True:
        report = httpx.get(f"{url}/debug/integrity", timeout=60).json()
        idle = report["num_running"] == report["num_waiting"] == report["pools"].get("num_unfinished_outputs", 0) == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    pools = report["pools"]
    leaked = pools.get("kv_blocks_in_use", 0) + pools.get("state_slots_in_use", 0)
    leaked += pools.get("num_unfinished_outputs", 0)
    leaked += report["num_running"] + report["num_waiting"] + (0 if report["ok"] else 1)
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    running = [ln for ln in metrics.splitlines() if ln.startswith("recap:num_requests_running")]
    if not running or float(running[0].split()[-1]) != 0:
        leaked += 1
    return leaked, report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    model: list[str] = []
    if args.model:
        model = [args.model]
    elif not args.default_model:
        from recap.model import default_model
        from recap.model.testing import make_tiny_checkpoint

        path = make_tiny_checkpoint("bamba", workdir / "tiny-bamba", vocab_size=default_model.VOCAB_SIZE)
        default_model.save_tokenizer(path, default_model.SEED)
        model = [str(path)]
    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "recap.cli", "serve", *model, "--port", str(port), "--log-level", "warning",
           "--num-threads", str(args.server_threads), "--enable-debug-endpoints", *args.server_args]
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server did not start:\n{(workdir / 'server.log').read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (loopback only); default: start one")
    p.add_argument("--port", type=int, default=0, help="the self-started server's port (default: a free one)")
    p.add_argument("--model", help="model folder for the self-started server (default: a tiny Bamba)")
    p.add_argument("--default-model", action="store_true", help="self-start on the embedded default model")
    p.add_argument("--model-name", help="the `model` field to send (default: omit it)")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.15)
    p.add_argument("--bad-fraction", type=float, default=0.02)
    p.add_argument("--time-limit", type=float, default=7200.0, help="stop sending after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--memory-every", type=int, default=250, help="sample /debug/memory every N requests")
    p.add_argument("--warmup-fraction", type=float, default=0.5,
                   help="samples before this share of the requests are warm-up (allocator arenas, caches fill)")
    p.add_argument("--rss-slack-mib", type=float, default=64.0, help="resident growth allowed after warm-up")
    p.add_argument("--heap-slope-mib", type=float, default=2.0,
                   help="malloc bytes in use may grow at most this many MiB per 1k requests after warm-up (six 5k-"
                        "10k runs of the tiny model measured -0.7..+0.9; a 2 KiB-per-request leak fails it)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra `recap serve` flags")
    args = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory(prefix="recap-soak-") as tmp:
        if args.url:
            if urlparse(args.url).hostname not in LOOPBACK:
                raise SystemExit("the soak only targets loopback servers")
            url = args.url.rstrip("/")
        else:
            proc, url = _start_server(args, Path(tmp))
        memory: list[tuple[int, dict[str, Any]]] = []
        try:
            t, seconds = asyncio.run(_soak(url, args, memory))
            leaked, report = _leaks(url)
            final = _metrics(url)
            last = _memory(url)
            memory.append((t.sent, last))
            trimmed = _memory(url, trim=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    done = t.ok + t.aborts + t.rejected + t.errors
    hit = t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0
    print(f"requests {done} in {seconds:.1f}s ({done / seconds:.1f} req/s), concurrency {args.concurrency}")
    print(f"ok {t.ok}  aborts {t.aborts} ({t.timed_out} client timeouts)  rejected-as-expected {t.rejected}  "
          f"errors {t.errors}")
    print(f"cached prompt tokens (plain requests) {hit:.1%}")
    print(f"leaks {leaked}  integrity {'ok' if report['ok'] else report['error']}  pools {report['pools']}")
    counts_error = _counts_add_up(final, t)
    print("server counts: sent {} received {:.0f} = success {:.0f} + aborted {:.0f} + rejected {:.0f}: {}".format(
        t.sent, final.get("recap:api_requests_received_total", 0), final.get("recap:api_requests_total:success", 0),
        final.get("recap:api_requests_total:aborted", 0), final.get("recap:api_requests_total:rejected", 0),
        "ok" if counts_error is None else counts_error))
    records_error = _records_error(last)
    print(f"live records at the end: {last['per_request']}: {'ok' if records_error is None else records_error}")
    print("bounded records: " + ", ".join(f"{k} {v['count']}/{v['capacity']}" for k, v in last["bounded"].items()))
    trend = _trend(memory, args.warmup_fraction)
    for name, (slope, rise) in trend.items():
        unit, scale = ("MiB", MiB) if name.endswith("bytes") else ("", 1)
        print(f"{name} after warm-up: slope {slope / scale:+.3f} {unit}/1k requests, rise {rise / scale:+.1f} {unit}")
    grew = _bounded_growth(memory, args.warmup_fraction)
    print("bounded records grown after warm-up (each within its capacity; Python blocks count their keys): "
          + (", ".join(f"{k} {v:+d}" for k, v in grew.items()) or "none"))
    print("resident memory (MiB) at requests " + ", ".join(f"{i}: {m['process']['rss_bytes'] / MiB:.0f}"
                                                            for i, m in memory))
    proc_last, proc_trim = last["process"], trimmed["process"]
    in_use, free = (proc_last[k] or 0 for k in ("malloc_in_use_bytes", "malloc_free_bytes"))
    print(f"at the end: RSS {proc_last['rss_bytes'] / MiB:.1f} MiB, malloc in use {in_use / MiB:.1f} MiB, "
          f"malloc free {free / MiB:.1f} MiB; after malloc_trim RSS {proc_trim['rss_bytes'] / MiB:.1f} MiB")
    for s in t.error_samples:
        print("  error:", s)
    rss_rise = trend["rss_bytes"][1]
    heap_slope = trend["malloc_in_use_bytes"][0]
    flat = rss_rise <= args.rss_slack_mib * MiB and heap_slope <= args.heap_slope_mib * MiB
    ok = t.errors == 0 and leaked == 0 and counts_error is None and records_error is None and flat
    if args.json:
        args.json.write_text(json.dumps({
            "sent": t.sent, "ok": t.ok, "aborts": t.aborts, "client_timeouts": t.timed_out, "rejected": t.rejected,
            "errors": t.errors, "seconds": seconds, "leaks": leaked, "counts_error": counts_error,
            "records_error": records_error, "server_counts": final,
            "trend_per_1k": {k: {"slope": v[0], "rise": v[1]} for k, v in trend.items()},
            "memory": [{"requests": i, **m["process"]} for i, m in memory], "trimmed": proc_trim,
            "bounded": last["bounded"], "bounded_growth": grew, "passed": ok}, indent=1))
    return 0 if ok else 1


def _counts_add_up(m: dict[str, float], t: Tally) -> str | None:
    """None when received == success + aborted + rejected, the reasons sum to rejected, and every request
    sent was received (less client timeouts that may have left before their request arrived); else why not."""
    outcomes = {o: m.get(f"recap:api_requests_total:{o}", 0.0) for o in ("success", "aborted", "rejected")}
    received = m.get("recap:api_requests_received_total", 0.0)
    reasons = sum(v for k, v in m.items() if k.startswith("recap:api_requests_rejected_total:"))
    if received != sum(outcomes.values()) or reasons != outcomes["rejected"]:
        return f"received {received:.0f} != {outcomes} (rejected by reason: {reasons:.0f})"
    if not t.sent - t.timed_out <= received <= t.sent:
        return f"received {received:.0f} of {t.sent} sent ({t.timed_out} client timeouts)"
    return None


def _records_error(memory: dict[str, Any]) -> str | None:
    """None when no per-request record outlives its request (runner state: beyond the finished ids the next
    step frees) and every bounded one is within capacity."""
    live = {k: v for k, v in memory["per_request"].items() if v}
    pending = memory["next_step"]
    live.update({k: v for k, v in pending.items() if k != "finished_ids" and v > pending["finished_ids"]})
    over = {k: v for k, v in memory["bounded"].items() if v["count"] > v["capacity"]}
    if live or over:
        return f"live after the run: {live}; over capacity: {over}"
    return None


def _bounded_growth(memory: list[tuple[int, dict[str, Any]]], warmup_fraction: float) -> dict[str, int]:
    """Per bounded record that grew after warm-up: its last count minus its lowest."""
    tail = after_warmup([(i, 0.0) for i, _ in memory], warmup_fraction)
    samples = [m for i, m in memory if i >= tail[0][0]] if tail else []
    out: dict[str, int] = {}
    for name in samples[-1]["bounded"] if samples else ():
        counts = [m["bounded"][name]["count"] for m in samples if name in m["bounded"]]
        if counts[-1] > min(counts):
            out[name] = counts[-1] - min(counts)
    return out


def _trend(memory: list[tuple[int, dict[str, Any]]], warmup_fraction: float) -> dict[str, tuple[float, float]]:
    """Per series: (slope per 1k requests, rise) after warm-up."""
    out: dict[str, tuple[float, float]] = {}
    for name in MEMORY_SERIES:
        series = [(i, float(m["process"][name])) for i, m in memory if m["process"].get(name) is not None]
        tail = after_warmup(series, warmup_fraction)
        out[name] = (slope_per_1k(tail), growth(tail))
    return out


if __name__ == "__main__":
    sys.exit(main())
