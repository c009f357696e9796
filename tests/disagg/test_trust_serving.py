"""Transfer handles sent straight to a decode instance (issue 20): forged, replayed, altered or naming a
foreign address, each is refused (403) before anything is queued, registered or connected to; the cache
poisoning sequence leaves a victim's output equal to a single instance's."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from recap.model import default_model
from recap.model.testing import make_tiny_checkpoint
from tests.disagg.conftest import SERVE_FLAGS, START_TIMEOUT_S, Cluster, Instance, free_port, launch, metric
from tests.disagg.test_serving import answer, post

PATH = "/v1/completions"
VICTIM = {"prompt": "The victim's long shared system prompt. " * 12, "max_tokens": 16, "temperature": 0,
          "ignore_eos": True}


@pytest.fixture(scope="module")
def evil_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    """A prefill instance outside the deployment: other weights, its own secret."""
    root = tmp_path_factory.mktemp("evil")
    model = make_tiny_checkpoint("bamba", root / "bamba", seed=1, vocab_size=default_model.VOCAB_SIZE)
    default_model.save_tokenizer(model, default_model.SEED)
    inst = launch("evil-prefill", ["serve", str(model), *SERVE_FLAGS, "--role", "prefill", "--kv-secret",
                                   "an attacker's own secret", "--kv-port", str(free_port())], root)
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


def handle_from(prefill_url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(prefill_url, PATH, {**body, "kv_transfer_params": {"do_remote_decode": True}})
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
    genuine = handle_from(cluster.prefill.url, body)
    port = listener.getsockname()[1]
    # Foreign addresses: an instance outside the deployment, and a bare port (with a genuine tag).
    refused(cluster, body, handle_from(evil_prefill.url, body), "not a prefill peer")
    refused(cluster, body, {**genuine, "remote_address": f"tcp://127.0.0.1:{port}"}, "not a prefill peer")
    # Forged or altered: a peer's address under the attacker's tag; a genuine handle with another first token
    # or for another prompt.
    evil = handle_from(evil_prefill.url, body)
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
        evil = handle_from(evil_prefill.url, VICTIM)
        if address == "peer":
            evil["remote_address"] = handle_from(cluster.prefill.url, {**VICTIM, "prompt": "x"})["remote_address"]
        r = post(cluster.decode.url, PATH, {**VICTIM, "kv_transfer_params": evil})
        assert r.status_code == 403, r.text
    single, disagg = answer(post(cluster.single.url, PATH, VICTIM)), answer(post(cluster.proxy.url, PATH, VICTIM))
    assert disagg == single  # text and usage (cached_tokens included)
