"""Long greedy streams against a cluster, run in threads, for the tests that kill a replica under them."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import ray

from tests.server.conftest import MODEL_NAME


def stream(url: str, prompt: str, started: threading.Event, stop: threading.Event, result: dict[str, Any]) -> None:
    """One long greedy stream; records its events until it ends or `stop` is set (then disconnects)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[Any] = result.setdefault("events", [])
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            result["replica"] = r.headers.get("x-recap-replica")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
                if stop.is_set():
                    return
    finally:
        started.set()


def start_streams(url: str, prompts: list[str], wait_s: float,
                  ) -> tuple[list[dict[str, Any]], list[threading.Thread], threading.Event]:
    """One thread per prompt, each streaming; returns once every stream has its first event (or ended)."""
    results: list[dict[str, Any]] = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(url, p, started[i], stop, results[i]))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(wait_s)
    return results, threads, stop


def replica_actor(replica_id: str, deployment: str = "") -> Any:
    """The Ray actor of a Serve replica (of `deployment`, when given) by its replica id."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if deployment in entry["name"] and entry["name"].endswith(replica_id):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")
