"""Prefill and decode replicas on a local Ray cluster (loopback), the KV moved through Ray's object store.

One prefill and one decode replica behind the P/D ingress serve multi-turn sessions: greedy outputs equal
a single instance's; from the second turn on the decode replica resumes from what it registered of the
previous turn's transfer (its cached_tokens), so it asks for fewer blocks; nothing leaks on either side.
A slow test kills the decode replica under streams.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from recap.cluster.deploy import ClusterConfig, build_pd_app  # noqa: E402
from recap.engine.async_engine import AsyncEngine  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.http.limits import ServerLimits  # noqa: E402
from recap.launch.settings import ServerSettings  # noqa: E402
from recap.server.app import build_app  # noqa: E402
from tests.cluster.streams import replica_actor, start_streams  # noqa: E402
from tests.server.conftest import MODEL_NAME, ServerThread, engine_config, tiny_model  # noqa: E402, F401

SESSIONS, TURNS = 3, 3
APP = "recap-pd"


@pytest.fixture(scope="module")
def pd_cluster(tiny_model: Path, serve_url: str) -> Iterator[str]:  # noqa: F811
    config = dataclasses.replace(engine_config(tiny_model), num_threads=1)
    try:
        debug = ServerSettings(limits=ServerLimits(enable_debug=True))
        cluster = ClusterConfig(stats_period_s=0.2, app_name=APP)
        serve.run(build_pd_app(config, cluster, 1, 1, debug), name=APP, route_prefix="/pd")
        yield serve_url + "/pd"
    finally:
        serve.delete(APP)


def run_sessions(url: str, stream: bool = False) -> list[dict[str, Any]]:
    prompts = [f"Session {i} wonders about the colour of item {i * 11}, and keeps asking. " for i in range(SESSIONS)]
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for turn in range(TURNS):
            for i in range(SESSIONS):
                body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": 5, "temperature": 0}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                data = r.json()
                text = data["choices"][0]["text"]
                out.append({"turn": turn, "prompt": prompts[i], "text": text,
                            "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
                            "prefill": r.headers.get("x-recap-prefill-replica"),
                            "decode": r.headers.get("x-recap-replica")})
                prompts[i] = prompts[i] + text + f" Then question {turn} about {i + turn} follows. "
    return out


def test_prefill_and_decode_replicas_match_one_instance(tiny_model: Path, pd_cluster: str) -> None:  # noqa: F811
    single = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(tiny_model)))))
    single.start()
    try:
        one = run_sessions(single.url)
    finally:
        single.stop()
    pd = run_sessions(pd_cluster)
    assert [(r["prompt"], r["text"]) for r in pd] == [(r["prompt"], r["text"]) for r in one]
    assert all(r["prefill"] and r["decode"] for r in pd)
    # The decode replica registered each transfer: later turns resume there from what it received.
    assert all(r["cached"] > 0 for r in pd if r["turn"] > 0), [(r["turn"], r["cached"]) for r in pd]
    metrics = httpx.get(pd_cluster + "/metrics", timeout=60).text  # the decode replica's series
    received = _metric(metrics, "recap:disagg_transfers_received_total")
    local = _metric(metrics, "recap:disagg_blocks_local_total")
    registered = _metric(metrics, "recap:disagg_checkpoints_registered_total")
    assert received == SESSIONS * TURNS and local > 0 and registered > 0, (received, local, registered)
    # A streamed request takes the same path, and streams the same text.
    with httpx.stream("POST", pd_cluster + "/v1/completions", timeout=120,
                      json={"model": MODEL_NAME, "prompt": pd[-1]["prompt"], "max_tokens": 5, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == pd[-1]["text"]
    # Clients cannot inject a handle; bad bodies get the single instance's 400.
    r = httpx.post(pd_cluster + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert httpx.post(pd_cluster + "/v1/completions", content=b"{", timeout=60).status_code == 400
    # Nothing held, running or leaked on either side.
    deadline = time.monotonic() + 30
    while True:
        report = httpx.get(pd_cluster + "/debug/integrity", timeout=60).json()
        idle = all(r.get("num_running") == r.get("num_waiting") == 0 and r["pools"]["kv_blocks_in_use"] == 0
                   for r in report["replicas"].values())
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["ok"] and idle, report
    assert sorted(k.split("/")[0] for k in report["replicas"]) == ["decode", "prefill"], report


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.slow
def test_killed_decode_replica_fails_only_its_requests(pd_cluster: str) -> None:
    """Streams on a decode replica that dies end with an OpenAI error event; Serve's replacement serves the
    next requests; nothing stays held or in use on the prefill replica."""
    results, threads, stop = start_streams(pd_cluster, [f"Stream {i} counts boats number {i * 17}. " for i in range(3)],
                                           120)
    victims = {r["replica"] for r in results}
    assert len(victims) == 1, results  # one decode replica
    victim = victims.pop()
    ray.kill(replica_actor(victim), no_restart=True)
    for t in threads:
        t.join(60)
    cut = [r for r in results if "error" in r["events"][-2]]
    assert cut, [r["events"][-2:] for r in results]
    for r in cut:
        error = r["events"][-2]["error"]
        assert r["events"][-1] == "[DONE]" and error["code"] == "replica_unavailable", error
    deadline = time.monotonic() + 120
    while True:  # Serve starts a replacement decode replica
        report = httpx.get(pd_cluster + "/debug/integrity", timeout=60).json()
        decode = [k for k in report["replicas"] if k.startswith("decode/") and k != f"decode/{victim}"]
        if decode or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert decode, report
    r = httpx.post(pd_cluster + "/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": "After the crash", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-recap-replica"] != victim
    deadline = time.monotonic() + 30
    while True:
        report = httpx.get(pd_cluster + "/debug/integrity", timeout=60).json()
        prefill = [v for k, v in report["replicas"].items() if k.startswith("prefill/")]
        if all(p["num_running"] == 0 and p["pools"]["kv_blocks_in_use"] == 0 for p in prefill):
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.2)
    assert report["ok"], report
