"""A client that goes away aborts its request: every KV block and state slot returns to the pools."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, metric, wait_idle

# Tokens asked for: a disconnected request is aborted before it has them all. The tiny model decodes ~1,500
# tokens/s on a fast core, so "how far short" is not a timing-free measure: the abort itself is counted.
LONG = 1000


def _assert_all_returned(http: httpx.Client) -> None:
    report = wait_idle(http, timeout=10)
    assert report["ok"], report["error"]
    pools = report["pools"]
    assert pools["kv_blocks_in_use"] == 0 and pools["state_slots_in_use"] == 0, pools
    assert pools["num_unfinished_outputs"] == 0, pools
    assert pools["kv_blocks_free"] == pools["kv_blocks_total"], pools
    assert pools["state_slots_free"] + pools["state_checkpoints"] == pools["state_slots_total"], pools


def _generated(http: httpx.Client) -> float:
    wait_idle(http)
    return metric(http, "recap:generation_tokens_total")


def _aborted(http: httpx.Client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "recap:request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


STREAMS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me everything."}]}),
    ("completion", "/v1/completions", {"prompt": "Once upon a time"}),
    ("batch-n2", "/v1/completions", {"prompt": ["Once upon a time", "In the beginning"], "n": 2}),
]


@pytest.mark.parametrize(("path", "body"), [s[1:] for s in STREAMS], ids=[s[0] for s in STREAMS])
def test_stream_closed_early_aborts(http: httpx.Client, server: Any, path: str, body: dict[str, Any]) -> None:
    before, aborted = _generated(http), _aborted(http)
    body = {"model": MODEL_NAME, "max_tokens": LONG, "ignore_eos": True, "stream": True, **body}
    with httpx.Client(base_url=server.url, timeout=60) as h, h.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    # the connection is closed here, mid-stream
    _assert_all_returned(http)
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert _aborted(http) == aborted + prompts  # one finished request per prompt
    assert _generated(http) - before < LONG * body.get("n", 1) * prompts


def test_plain_request_abandoned_aborts(http: httpx.Client, server: Any) -> None:
    before, aborted = _generated(http), _aborted(http)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True}
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.3)) as h, pytest.raises(
        httpx.ReadTimeout
    ):
        h.post("/v1/completions", json=body)
    _assert_all_returned(http)
    assert time.monotonic() - t0 < 10
    assert _aborted(http) == aborted + 1
    assert _generated(http) - before < LONG


def test_server_still_serves_after_disconnects(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4,
                                           "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    _assert_all_returned(http)
