"""Hostile input, slow clients, auth and admission against a server with tight limits (issue 20).

Every bad request is a 4xx JSON OpenAI error naming the problem, and a well-formed request on the same
keep-alive connection then succeeds; slow clients are cut off by the timeouts while others are served;
--api-key guards every /v1 route; past --max-queued a 429 with Retry-After."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.http.limits import ServerLimits
from recap.http.timeouts import header_timeout_protocol
from recap.server.app import build_app
from tests.server.conftest import ServerThread, engine_config
from tests.server.hostile import MODEL, Case, corpus, well_formed

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(max_body_bytes=2**20, max_prompts=8, max_stop=4, max_logit_bias=4, max_queued=3,
                      header_timeout_s=1.0, body_timeout_s=1.5, idle_timeout_s=30, enable_debug=True)


@pytest.fixture(scope="module")
def guarded(tiny_model: Path) -> Iterator[ServerThread]:
    engine = AsyncEngine(LLMEngine(dataclasses.replace(engine_config(tiny_model), max_n=4)))
    srv = ServerThread(build_app(engine, limits=LIMITS, api_key=KEY), http=header_timeout_protocol(1.0),
                       timeout_keep_alive=30)
    srv.start()
    yield srv
    srv.stop()


def local_port(r: httpx.Response) -> int:
    """The client side's port of the connection `r` came over (same port: same keep-alive connection)."""
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def check_case(c: httpx.Client, case: Case, follow_path: str = "/v1/completions") -> None:
    r = c.request(case.method, case.path, content=case.body, headers={"Content-Type": "application/json"})
    assert r.status_code == case.status, (case.name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and case.words in err["message"], (case.name, err)
    assert r.headers.get("connection", "").lower() != "close", case.name
    port = local_port(r)
    ok = c.post(follow_path, json=well_formed(follow_path))
    assert ok.status_code == 200, (case.name, ok.text)
    assert local_port(ok) == port, f"{case.name}: the keep-alive connection was closed"


LIMIT_CASES = [
    Case("too-many-prompts", "/v1/completions", b'{"prompt":["a","b","c","d","e","f","g","h","i"]}', 400,
         "--max-prompts"),
    Case("too-many-stops", "/v1/completions", b'{"prompt":"a","stop":["a","b","c","d","e"]}', 400, "--max-stop"),
    Case("too-big-logit-bias", "/v1/completions", b'{"prompt":"a","logit_bias":{"1":1,"2":1,"3":1,"4":1,"5":1}}',
         400, "--max-logit-bias"),
    Case("n-over-limit", "/v1/completions", b'{"prompt":"a","n":5}', 400, "--max-n"),
]


@pytest.mark.parametrize("case", corpus() + LIMIT_CASES, ids=lambda c: c.name)
def test_hostile_corpus_against_the_server(guarded: ServerThread, case: Case) -> None:
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        check_case(c, case, "/v1/chat/completions" if "chat" in case.path else "/v1/completions")


def test_an_unexpected_exception_fails_only_its_request(guarded: ServerThread, caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    state = guarded.server.config.app.state.recap  # type: ignore[attr-defined]
    prepare = state.engine.prepare

    def broken(prompt: Any, *a: Any, **kw: Any) -> Any:
        if prompt == "boom":
            raise RuntimeError("a bug in preparing")
        return prepare(prompt, *a, **kw)

    monkeypatch.setattr(state.engine, "prepare", broken)
    with caplog.at_level(logging.ERROR, logger="recap.server"), httpx.Client(
            base_url=guarded.url, headers=AUTH, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 2})
        assert r.status_code == 500 and "a bug in preparing" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json=well_formed())
        assert ok.status_code == 200 and local_port(ok) == local_port(r)
    assert any(rec.exc_info and "a bug in preparing" in str(rec.exc_info[1]) for rec in caplog.records)


def test_a_body_over_the_limit_is_a_413(guarded: ServerThread) -> None:
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as c:
        big = b'{"prompt":"' + b"x" * (2**20 + 10) + b'"}'
        r = c.post("/v1/completions", content=big)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # chunked: no Content-Length, counted as it arrives
            yield b'{"prompt":"'
            for _ in range(20):
                yield b"y" * 65536
            yield b'"}'

        r = c.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        assert c.post("/v1/completions", json=well_formed()).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", well_formed()),
    ("POST", "/v1/chat/completions", well_formed("/v1/chat/completions")),
    ("GET", "/v1/models", None),
    ("GET", "/debug/integrity", None),
])
def test_api_key_guards_every_v1_route(guarded: ServerThread, method: str, path: str, body: Any) -> None:
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert c.request(method, path, json=body, headers=AUTH).status_code == 200


def test_health_and_metrics_stay_open(guarded: ServerThread) -> None:
    for path in ("/health", "/metrics"):
        assert httpx.get(guarded.url + path, timeout=30).status_code == 200


def test_debug_is_off_unless_enabled(server: ServerThread, tiny_model: Path) -> None:
    app = build_app(AsyncEngine(LLMEngine(engine_config(tiny_model))), shutdown_engine=True)
    assert not any(getattr(r, "path", "").startswith("/debug") for r in app.routes)
    assert any(getattr(r, "path", "") == "/debug/integrity" for r in server.server.config.app.routes)  # type: ignore


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after `seconds`."""
    s.settimeout(seconds)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_slow_clients_are_cut_off_while_others_are_served(guarded: ServerThread) -> None:
    silent = [_raw(guarded.port) for _ in range(10)]  # connect, send nothing
    dripping = [_raw(guarded.port) for _ in range(10)]  # headers a few bytes at a time, never finished
    slow_body = [_raw(guarded.port) for _ in range(5)]  # complete headers, then a body that never completes
    for s in dripping:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for s in slow_body:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            for s in dripping:
                with contextlib.suppress(OSError):
                    s.sendall(b"X")
            time.sleep(0.2)

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        served = 0
        with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as c:
            for _ in range(3):  # others are served meanwhile
                r = c.post("/v1/completions", json=well_formed())
                assert r.status_code == 200, r.text
                served += 1
        assert served == 3
        for s in silent + dripping:
            assert _closed_within(s, 5.0) is not None, "a slow connection was not closed"
        for s in slow_body:
            reply = _closed_within(s, 5.0)
            assert reply is not None and b" 408 " in reply.split(b"\r\n", 1)[0], reply
    finally:
        stop.set()
        dripper.join()
        for s in silent + dripping + slow_body:
            s.close()


def test_past_max_queued_a_429_with_retry_after(guarded: ServerThread) -> None:
    long = {"model": MODEL, "prompt": "count", "max_tokens": 1000, "ignore_eos": True}
    statuses: list[int] = []

    def hold() -> None:
        statuses.append(httpx.post(guarded.url + "/v1/completions", json=long, headers=AUTH, timeout=120).status_code)

    threads = [threading.Thread(target=hold) for _ in range(LIMITS.max_queued)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as c:
            deadline = time.monotonic() + 60
            while (rep := c.get("/debug/integrity").json())["num_running"] + rep["num_waiting"] < LIMITS.max_queued:
                assert time.monotonic() < deadline, rep
                time.sleep(0.01)
            r = c.post("/v1/completions", json=well_formed())
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "server_busy"
            assert c.get("/health").status_code == 200  # not counted
    finally:
        for t in threads:
            t.join()
    assert statuses == [200] * LIMITS.max_queued
    r = httpx.post(guarded.url + "/v1/completions", json=well_formed(), headers=AUTH, timeout=60)
    assert r.status_code == 200


def counts(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith(("recap:api_requests", "recap:request_success")):
                key = s.labels.get("outcome") or s.labels.get("reason") or s.labels.get("finished_reason") or ""
                out[f"{s.name}:{key}" if key else s.name] = s.value
    return out


def test_every_request_is_counted_once_success_aborted_or_rejected(guarded: ServerThread) -> None:
    before = counts(guarded.url)
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as c:
        assert c.post("/v1/completions", json=well_formed()).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "bogus": 1}).status_code == 400
        assert c.post("/v1/completions", json=well_formed(), headers={"Authorization": "no"}).status_code == 401
        body = {"model": MODEL, "prompt": "count", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())  # then leave mid-stream
    deadline = time.monotonic() + 30
    while (after := counts(guarded.url))["recap:api_requests_in_progress"] > 0:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["recap:api_requests_received_total"] == 4
    assert (delta["recap:api_requests_total:success"], delta["recap:api_requests_total:aborted"],
            delta["recap:api_requests_total:rejected"]) == (1, 1, 2)
    assert delta["recap:api_requests_rejected_total:invalid_request"] == 1
    assert delta["recap:api_requests_rejected_total:unauthorized"] == 1
    assert after["recap:api_requests_received_total"] == sum(after[f"recap:api_requests_total:{o}"]
                                                             for o in ("success", "aborted", "rejected"))
    # The engine's view (one per prompt that reached it): the aborted stream is an abort, not a success.
    assert delta["recap:request_success_total:abort"] == 1
    assert delta["recap:request_success_total:length"] + delta["recap:request_success_total:stop"] == 1
    assert delta["recap:request_success_total:error"] == 0
