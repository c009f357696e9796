"""Transfer handles sent straight to a decode instance (issue 20): forged, replayed, altered or naming a
foreign address, each is refused (403) before anything is queued, registered or connected to; the cache
poisoning sequence leaves a victim's output equal to a single instance's. And `do_remote_decode` sent
straight to a prefill instance without the front end's credential is refused (issue 36)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from recap.disagg.trust import derive_api_key
from recap.http.wire import KV_API_KEY_HEADER
from recap.model import default_model
from recap.model.testing import make_tiny_checkpoint
from tests.disagg.conftest import (
    MODEL_NAME,
    SERVE_FLAGS,
    START_TIMEOUT_S,
    Cluster,
    Instance,
    free_port,
    launch,
    metric,
)
from tests.disagg.test_serving import answer, post

PATH = "/v1/completions"
EVIL_SECRET = "an attacker's own secret"
VICTIM = {"prompt": "The victim's long shared system prompt. " * 12, "max_tokens": 16, "temperature": 0,
          "ignore_eos": True}


@pytest.fixture(scope="module")
def evil_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    """A prefill instance outside the deployment: other weights, its own secret."""
    root = tmp_path_factory.mktemp("evil")
    model = make_tiny_checkpoint("bamba", root / "bamba", seed=1, vocab_size=default_model.VOCAB_SIZE)
    default_model.save_tokenizer(model, default_model.SEED)
    inst = launch("evil-prefill", ["serve", str(model), *SERVE_FLAGS, "--role", "prefill", "--kv-secret",
                                   EVIL_SECRET, "--kv-port", str(free_port())], root)
    try:
        inst.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield inst
    finally:
        inst.stop()


@pytest.fixture()
def listener() -> Iterator[socket.socket]:
    """A loopback TCP port that counts who connects to it (nobody may)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s


def accepted(s: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = s.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def handle_from(prefill: Instance, body: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    """A handle of the cluster's prefill instance, or of the evil one (which takes its own secret's key)."""
    key = cluster.kv_api_key if prefill is cluster.prefill else derive_api_key(EVIL_SECRET.encode())
    r = httpx.post(f"{prefill.url}{PATH}", json={"model": MODEL_NAME, **body, "kv_transfer_params": {
        "do_remote_decode": True}}, headers={KV_API_KEY_HEADER: key}, timeout=120)
    assert r.status_code == 200, r.text
    return {**r.json()["kv_transfer_params"], "do_remote_prefill": True}


def refused(cluster: Cluster, body: dict[str, Any], handle: dict[str, Any], words: str) -> None:
    r = post(cluster.decode.url, PATH, {**body, "kv_transfer_params": handle})
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_refused" and words in err["message"], err


def test_untrusted_handles_are_refused_before_any_connection(cluster: Cluster, evil_prefill: Instance,
                                                             listener: socket.socket) -> None:
    decode = cluster.decode.url
    names = ("recap:disagg_transfers_received_total", "recap:disagg_transfers_failed_total",
             "recap:disagg_handles_refused_total")
    before = [metric(decode, n) for n in names]
    body = {"prompt": "a prompt for the handle checks", "max_tokens": 4, "temperature": 0}
    genuine = handle_from(cluster.prefill, body, cluster)
    port = listener.getsockname()[1]
    # Foreign addresses: an instance outside the deployment, and a bare port (with a genuine tag).
    refused(cluster, body, handle_from(evil_prefill, body, cluster), "not a prefill peer")
    refused(cluster, body, {**genuine, "remote_address": f"tcp://127.0.0.1:{port}"}, "not a prefill peer")
    # Forged or altered: a peer's address under the attacker's tag; a genuine handle with another first token
    # or for another prompt.
    evil = handle_from(evil_prefill, body, cluster)
    refused(cluster, body, {**evil, "remote_address": genuine["remote_address"]}, "does not verify")
    refused(cluster, body, {**genuine, "first_token_id": genuine["first_token_id"] + 1}, "does not verify")
    refused(cluster, {**body, "prompt": "another prompt"}, genuine, "does not verify")
    # The genuine handle works once; the replay is refused.
    answer(post(decode, PATH, {**body, "kv_transfer_params": genuine}))
    refused(cluster, body, genuine, "replay")
    after = [metric(decode, n) for n in names]
    assert after[0] == before[0] + 1 and after[1] == before[1] and after[2] == before[2] + 6
    assert accepted(listener) == 0
    assert metric(evil_prefill.url, "recap:disagg_transfers_sent_total") == 0  # nobody pulled from it


def test_cache_poisoning_sequence_leaves_the_victim_equal_to_a_single_instance(cluster: Cluster,
                                                                               evil_prefill: Instance) -> None:
    """The attack of issue 20: KV computed by other weights, pushed for the victim's prompt straight to the
    decode instance; then the victim's request through the real proxy."""
    for address in (None, "peer"):  # the attacker's own address, then a peer's address under a forged tag
        evil = handle_from(evil_prefill, VICTIM, cluster)
        if address == "peer":
            evil["remote_address"] = handle_from(cluster.prefill, {**VICTIM, "prompt": "x"}, cluster)["remote_address"]
        r = post(cluster.decode.url, PATH, {**VICTIM, "kv_transfer_params": evil})
        assert r.status_code == 403, r.text
    single, disagg = answer(post(cluster.single.url, PATH, VICTIM)), answer(post(cluster.proxy.url, PATH, VICTIM))
    assert disagg == single  # text and usage (cached_tokens included)


def test_do_remote_decode_is_taken_only_from_the_front_end(cluster: Cluster) -> None:
    """Issue 36, N7: `do_remote_decode` requests sent straight to the prefill instance without the proxy's
    credential (none, or a wrong one), many at once, are each refused with a 401 before anything is queued or
    held; a request through the proxy still completes, and nothing is left held."""
    prefill = cluster.prefill.url
    held = metric(prefill, "recap:disagg_requests_held")  # other tests' holds expire on their own
    body = {"model": MODEL_NAME, "prompt": "hold this for me " * 8, "max_tokens": 4,
            "kv_transfer_params": {"do_remote_decode": True}}
    keys = [None, "", "wrong", cluster.kv_api_key[:-1], cluster.kv_api_key.upper()]

    def direct(i: int) -> httpx.Response:
        key = keys[i % len(keys)]
        headers = {} if key is None else {KV_API_KEY_HEADER: key}
        return httpx.post(f"{prefill}{PATH}", json=body, headers=headers, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(direct, range(60)))
    assert {r.status_code for r in answers} == {401}, {r.status_code: r.text for r in answers}
    error = answers[0].json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "kv_api_key_invalid"), error
    assert metric(prefill, "recap:disagg_requests_held") <= held
    r = post(cluster.proxy.url, PATH, {"prompt": "a legitimate request", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert cluster.kv_api_key not in r.text
