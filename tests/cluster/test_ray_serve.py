"""Two recap replicas on a local Ray cluster (loopback) behind the checkpoint-aware router.

On the session's local Ray cluster (tests/cluster/conftest.py): app `recap` (ingress at / + 2 replicas)
and a round-robin ingress at /rr over the same replicas. Sessions are salted per run, so runs on the same
replicas never share cache entries.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from recap.cluster.deploy import ClusterConfig, build_cluster_app, ingress_app  # noqa: E402
from recap.engine.async_engine import AsyncEngine  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.http.limits import ServerLimits  # noqa: E402
from recap.http.response_ids import tag_of  # noqa: E402
from recap.launch.settings import ServerSettings  # noqa: E402
from recap.server.app import build_app  # noqa: E402
from tests.cluster.streams import replica_actor, start_streams  # noqa: E402
from tests.server.conftest import MODEL_NAME, ServerThread, engine_config, tiny_model  # noqa: E402, F401

SESSIONS, TURNS = 5, 3  # an odd number of sessions: round robin moves every session each turn


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:  # noqa: F811 - the server tests' session-wide tiny Bamba, built once
    return tiny_model


@pytest.fixture(scope="module")
def cluster(model: Path, serve_url: str) -> Iterator[str]:
    config = dataclasses.replace(engine_config(model), num_threads=1)
    try:
        debug = ServerSettings(limits=ServerLimits(enable_debug=True))  # /debug/integrity on every replica
        serve.run(build_cluster_app(config, ClusterConfig(num_replicas=2, stats_period_s=0.2), debug), name="recap",
                  route_prefix="/")
        serve.run(ingress_app(str(model), "round_robin", "recap", debug), name="recap-rr", route_prefix="/rr")
        yield serve_url
    finally:
        serve.delete("recap-rr")
        serve.delete("recap")


def run_sessions(url: str, salt: str | None) -> list[dict[str, Any]]:
    """SESSIONS conversations of TURNS turns, one request at a time, turns interleaved across sessions;
    each turn's prompt extends the previous prompt and its (greedy) completion."""
    prompts = [f"Session {i} asks about topic {i * 7}: tell me something about the number {i} please. "
               for i in range(SESSIONS)]
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for turn in range(TURNS):
            for i in range(SESSIONS):
                body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": 6, "temperature": 0}
                if salt is not None:
                    body["cache_salt"] = salt
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                data = r.json()
                text = data["choices"][0]["text"]
                out.append({"session": i, "turn": turn, "prompt": prompts[i], "text": text,
                            "prompt_tokens": data["usage"]["prompt_tokens"],
                            "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
                            "replica": r.headers.get("x-recap-replica")})
                prompts[i] = prompts[i] + text + f" Next question {turn}: and what about {i + turn}? "
    return out


def hit_rate(results: list[dict[str, Any]]) -> float:
    return sum(r["cached"] for r in results) / sum(r["prompt_tokens"] for r in results)


def test_two_replicas_match_one_instance_and_beat_round_robin(model: Path, cluster: str) -> None:
    single = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(model)))))
    single.start()
    try:
        one = run_sessions(single.url, None)
    finally:
        single.stop()
    routed = run_sessions(cluster, "checkpoint-run")
    rr = run_sessions(cluster + "/rr", "round-robin-run")
    # Greedy outputs equal a single instance's (and so every later prompt does too).
    assert [(r["prompt"], r["text"]) for r in routed] == [(r["prompt"], r["text"]) for r in one]
    assert [(r["prompt"], r["text"]) for r in rr] == [(r["prompt"], r["text"]) for r in one]
    # Sessions spread over both replicas, and each stays where its checkpoints are.
    homes = {i: {r["replica"] for r in routed if r["session"] == i} for i in range(SESSIONS)}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set.union(*homes.values())) == 2, homes
    print(f"token hit rate: single {hit_rate(one):.3f} checkpoint-routed {hit_rate(routed):.3f} "
          f"round-robin {hit_rate(rr):.3f}")
    assert hit_rate(one) > 0.3  # the workload reuses prefixes at all
    assert hit_rate(routed) >= hit_rate(one) - 0.02
    assert hit_rate(routed) > hit_rate(rr)
    report = httpx.get(cluster + "/debug/integrity", timeout=60).json()
    assert report["ok"] and len(report["replicas"]) == 2, report
    assert httpx.get(cluster + "/rr/debug/integrity", timeout=60).status_code == 404  # its debug is off


def test_stored_responses_are_found_on_the_replica_that_stored_them(cluster: str) -> None:
    """Chains of /v1/responses turns by previous_response_id, started on both replicas (first turns through the
    round-robin ingress): every follow-up, GET
    and DELETE reaches the replica whose id the response id carries (also through the round-robin ingress,
    which would alternate), and a follow-up's prompt is read from that replica's cache. Runs before the kill
    test below, while both replicas live."""
    chains: list[list[str]] = [[] for _ in range(4)]
    with httpx.Client(base_url=cluster, timeout=120) as http:
        for turn in range(3):
            for i, chain in enumerate(chains):
                body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "max_output_tokens": 4,
                                        "input": f"Chain {i}, turn {turn}: name one valve of loop {i * 11}, please."}
                if chain:
                    body["previous_response_id"] = chain[-1]
                # First turns through the round-robin ingress, which alternates: the checkpoint router would
                # rightly keep them together (they share the chat template's KV prefix, where the branch
                # point is learned), spreading them only while one was still in flight.
                r = http.post(("/rr" if turn == 0 else "") + "/v1/responses", json=body)
                assert r.status_code == 200, r.text
                rid, tag = r.json()["id"], tag_of(r.json()["id"])
                assert tag == r.headers["x-recap-replica"], (rid, r.headers)  # ids name their replica
                assert not chain or tag == tag_of(chain[-1]), (rid, chain)  # a follow-up stays home
                assert turn == 0 or r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0, r.json()
                chain.append(rid)
        homes = {tag_of(chain[0]) for chain in chains}
        assert len(homes) == 2, chains  # chains live on both replicas: a follow-up sent by load could miss
        for ingress in ("", "/rr"):
            for rid in (rid for chain in chains for rid in chain):
                r = http.get(f"{ingress}/v1/responses/{rid}")
                assert r.status_code == 200 and r.json()["id"] == rid, r.text
                assert r.headers["x-recap-replica"] == tag_of(rid)
        for chain in chains:
            r = http.delete(f"/rr/v1/responses/{chain[-1]}")
            assert r.status_code == 200 and r.json()["deleted"], r.text
            assert http.get(f"/v1/responses/{chain[-1]}").status_code == 404
            assert http.get(f"/v1/responses/{chain[0]}").status_code == 200  # only that one was forgotten


def test_killed_replica_fails_only_its_requests(cluster: str) -> None:
    results, threads, stop = start_streams(cluster, [f"Stream {i} counts sheep number {i * 13}. " for i in range(6)],
                                           60)
    replicas = {r["replica"] for r in results}
    assert len(replicas) == 2, results  # load spread the concurrent streams over both replicas
    # The victim: the replica of the stream with the most left to do (short streams may be done already).
    running = [r for r in results if r["events"][-1] != "[DONE]"]
    assert running, "every stream finished before the kill: make them longer"
    victim = min(running, key=lambda r: len(r["events"]))["replica"]
    counts = [len(r["events"]) for r in results]
    ray.kill(replica_actor(victim, "RecapReplica"), no_restart=True)
    on_victim = [i for i, r in enumerate(results) if r["replica"] == victim]
    cut = 0
    for i in on_victim:  # cut off: an OpenAI error event, then the end of the stream (unless it had just finished)
        threads[i].join(60)
        events = results[i]["events"]
        assert events[-1] == "[DONE]", events[-2:]
        if "error" in events[-2]:
            assert events[-2]["error"]["code"] == "replica_unavailable", events[-2]
            assert events[-2]["error"]["type"] == "service_unavailable", events[-2]
            cut += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    assert cut >= 1
    # The survivor's streams go on past the kill; then their clients leave (which aborts them).
    deadline = time.monotonic() + 60
    survivors = [i for i in range(len(results)) if i not in on_victim]
    def progressed(i: int) -> bool:
        events = results[i]["events"]
        return events[-1] == "[DONE]" or len(events) >= counts[i] + 5

    while not all(progressed(i) for i in survivors) and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in survivors:  # no error: each went on (or had finished)
        assert progressed(i), (len(results[i]["events"]), counts[i])
        assert all("choices" in e for e in results[i]["events"] if e != "[DONE]"), results[i]["events"][-2:]
    stop.set()
    for t in threads:
        t.join(60)
    # Serve drops the dead replica (and starts a replacement); later requests succeed.
    deadline = time.monotonic() + 60
    while True:
        report = httpx.get(cluster + "/debug/integrity", timeout=60).json()
        if victim not in report["replicas"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert victim not in report["replicas"], report
    with httpx.Client(base_url=cluster, timeout=120) as http:
        for i in range(4):
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": f"After the crash {i}",
                                                   "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.headers["x-recap-replica"] != victim
    survivor = next(iter(replicas - {victim}))
    deadline = time.monotonic() + 30
    while True:  # the aborted streams leave the survivor's pools; nothing leaks
        report = httpx.get(cluster + "/debug/integrity", timeout=60).json()
        mine = report["replicas"][survivor]
        if mine["num_running"] == mine["num_waiting"] == mine["pools"]["num_unfinished_outputs"] == 0:
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.1)
    assert report["ok"], report
    assert mine["pools"]["kv_blocks_in_use"] == 0 and mine["pools"]["state_slots_in_use"] == 0, report
