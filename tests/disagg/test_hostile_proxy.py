"""The proxy under hostile input and faults (issue 20): the corpus through the proxy, --api-key, a client
that leaves, a decode instance that is gone or dies mid-stream."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from recap.disagg.proxy import ProxyConfig, build_proxy_app
from recap.http.limits import ServerLimits
from tests.disagg.conftest import SERVE_FLAGS, START_TIMEOUT_S, Cluster, Instance, free_port, launch, metric, wait_idle
from tests.server.conftest import ServerThread
from tests.server.hostile import MODEL, Case, corpus, well_formed
from tests.server.test_hostile import check_case

KEY = "sk-proxy-test-key"


@pytest.mark.parametrize("case", corpus(), ids=lambda c: c.name)
def test_hostile_corpus_through_the_proxy(cluster: Cluster, case: Case) -> None:
    with httpx.Client(base_url=cluster.proxy.url, timeout=120, limits=httpx.Limits(max_connections=1)) as c:
        check_case(c, case, "/v1/chat/completions" if "chat" in case.path else "/v1/completions")


def proxy_to(cluster: Cluster, prefill: str, decode: str, **kw: object) -> ServerThread:
    config = ProxyConfig((prefill,), (decode,), timeout_s=120, kv_api_key=cluster.kv_api_key)
    srv = ServerThread(build_proxy_app(config, **kw))  # type: ignore[arg-type]
    srv.start()
    return srv


def bad_gateway(url: str, stream: bool = False) -> dict[str, object]:
    """POST a well-formed completion through the proxy at `url`; it must be a 502: its OpenAI error object."""
    r = httpx.post(f"{url}/v1/completions", json={**well_formed(), "stream": stream}, timeout=60)
    assert r.status_code == 502, r.text
    return r.json()["error"]


def test_api_key_guards_the_proxy(cluster: Cluster) -> None:
    srv = proxy_to(cluster, cluster.prefill.url, cluster.decode.url, limits=ServerLimits(), api_key=KEY)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            for method, path, body in (("POST", "/v1/completions", well_formed()), ("GET", "/v1/models", None),
                                       ("POST", "/v1/chat/completions", well_formed("/v1/chat/completions"))):
                r = c.request(method, path, json=body)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
                r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, r.text
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()


def test_a_client_that_leaves_cancels_the_decode_work(cluster: Cluster) -> None:
    """Not streamed: the proxy notices the disconnect and closes its upstream request, which aborts it."""
    long = {"model": MODEL, "prompt": "Count with me: one two three", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True}
    decode = cluster.decode.url
    before = metric(decode, "recap:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        # the client leaves long before 900 tokens (the tiny model decodes them in about a second)
        httpx.post(f"{cluster.proxy.url}/v1/completions", json=long, timeout=httpx.Timeout(120, read=0.3))
    wait_idle(decode, timeout=10)
    generated = metric(decode, "recap:generation_tokens_total") - before
    assert generated < 900, generated  # aborted, not run to max_tokens


def test_a_decode_instance_that_is_gone_releases_the_prefill_side_at_once(cluster: Cluster) -> None:
    srv = proxy_to(cluster, cluster.prefill.url, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        assert bad_gateway(srv.url)["code"] == "upstream_unreachable"
        deadline = time.monotonic() + 15  # the hold timeout is 60 s: a loaded box answers /metrics slowly
        while metric(cluster.prefill.url, "recap:disagg_requests_held") > 0:
            assert time.monotonic() < deadline, "the prefill side still holds the request"
            time.sleep(0.05)
        wait_idle(cluster.prefill.url, timeout=5)
    finally:
        srv.stop()


@pytest.fixture()
def doomed_decode(cluster: Cluster, disagg_model: Path, tmp_path: Path) -> Iterator[Instance]:
    inst = launch("doomed-decode", ["serve", str(disagg_model), *SERVE_FLAGS, "--role", "decode", *cluster.trust,
                                    "--kv-peer", cluster.kv_prefill], tmp_path)
    try:
        inst.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield inst
    finally:
        inst.stop()


def test_a_decode_that_dies_mid_stream_ends_the_stream_with_an_error_event(cluster: Cluster,
                                                                           doomed_decode: Instance) -> None:
    srv = proxy_to(cluster, cluster.prefill.url, doomed_decode.url)
    events: list[dict] = []
    try:
        body = {"model": MODEL, "prompt": "Count with me", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            done = False
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        threading.Thread(target=doomed_decode.proc.kill).start()
        assert done and len(events) > 3
        error = events[-1].get("error")
        assert error is not None and error["code"] == "upstream_stream_broken", events[-1]
        assert all("error" not in e for e in events[:-1])
    finally:
        srv.stop()


@pytest.fixture()
def foreign_decode(cluster: Cluster, disagg_model: Path, tmp_path: Path) -> Iterator[Instance]:
    """A decode instance of the deployment (same secret) whose only prefill peer is elsewhere: it refuses
    the prefill instance's handles (403 kv_transfer_refused)."""
    inst = launch("foreign-decode", ["serve", str(disagg_model), *SERVE_FLAGS, "--role", "decode", *cluster.trust,
                                     "--kv-peer", "tcp://127.0.0.1:1"], tmp_path)
    try:
        inst.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield inst
    finally:
        inst.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_transfer_handle_is_a_502_naming_the_refusal(cluster: Cluster, foreign_decode: Instance,
                                                               stream: bool) -> None:
    """The decode side refuses the handle the proxy forwarded (not from one of its peers): the client made no
    mistake, so it gets a 502 with an OpenAI error body carrying the decode side's reason, and the prefill
    side is told to release the held request at once."""
    srv = proxy_to(cluster, cluster.prefill.url, foreign_decode.url)
    held = metric(cluster.prefill.url, "recap:disagg_requests_held")  # other tests' holds expire on their own
    try:
        error = bad_gateway(srv.url, stream=stream)
        assert error["code"] == "kv_transfer_refused" and error["type"] == "upstream_error", error
        assert "not a prefill peer" in error["message"] and foreign_decode.url in error["message"], error
        assert metric(foreign_decode.url, "recap:disagg_handles_refused_total") >= 1
        deadline = time.monotonic() + 15  # the hold timeout is 60 s: a loaded box answers /metrics slowly
        while metric(cluster.prefill.url, "recap:disagg_requests_held") > held:
            assert time.monotonic() < deadline, "the prefill side still holds the request"
            time.sleep(0.05)
    finally:
        srv.stop()


def test_a_single_instance_behind_the_proxy_is_a_502_not_a_client_error(cluster: Cluster) -> None:
    """A decode URL that is not a decode instance refuses kv_transfer_params with a 400: a deployment
    mistake, reported as a 502 kv_transfer_refused."""
    srv = proxy_to(cluster, cluster.prefill.url, cluster.single.url)
    try:
        error = bad_gateway(srv.url)
        assert error["code"] == "kv_transfer_refused" and "single instance" in error["message"], error
    finally:
        srv.stop()


def test_an_upstream_bare_500_is_a_json_502(cluster: Cluster) -> None:
    """A prefill side answering a plain-text 500 (a crashed worker, a foreign server) gives the client a 502
    with an OpenAI error body naming it, not the bare 500."""
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    upstream = FastAPI()

    @upstream.post("/v1/completions")
    async def broken() -> PlainTextResponse:
        return PlainTextResponse("Internal Server Error", status_code=500)

    fake = ServerThread(upstream)
    fake.start()
    srv = proxy_to(cluster, fake.url, f"http://127.0.0.1:{free_port()}")
    try:
        error = bad_gateway(srv.url)
        assert error["code"] == "upstream_failed" and "Internal Server Error" in error["message"], error
    finally:
        srv.stop()
        fake.stop()


def test_no_per_request_record_outlives_a_disaggregated_request(cluster: Cluster) -> None:
    """Through the proxy, plain and streamed (one cut off by its client): once done, neither side keeps a
    per-request record of them (held requests, offers, handles included: recap.process.census). Other
    tests' requests held on the prefill side expire on their own: counts there may only go down."""
    def live(url: str) -> dict[str, int]:
        return httpx.get(f"{url}/debug/memory", timeout=30).json()["per_request"]

    before = live(cluster.prefill.url)
    with httpx.Client(base_url=cluster.proxy.url, timeout=120) as c:
        assert c.post("/v1/completions", json=well_formed()).status_code == 200
        with c.stream("POST", "/v1/completions", json={**well_formed(), "max_tokens": 50, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # then hang up
    deadline = time.monotonic() + 20
    while True:
        prefill, decode = live(cluster.prefill.url), live(cluster.decode.url)
        grown = {k: v for k, v in prefill.items() if v > before.get(k, 0)}
        busy = {k: v for k, v in decode.items() if v}
        if not grown and not busy:
            break
        assert time.monotonic() < deadline, (grown, busy)
        time.sleep(0.1)
    assert {"remote_held", "disagg_handles"} <= set(decode), decode
