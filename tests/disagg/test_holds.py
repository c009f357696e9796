"""P/D holds as a bounded resource (issue 36, N7): the outbox's accept and hold deadlines on explicit clocks,
and a prefill engine's global and per-client caps (a request past one is a 429 before it is queued)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from recap.disagg.config import KVTransferConfig, RemoteDecode, RemoteHandle
from recap.disagg.engine import DisaggLLMEngine
from recap.disagg.transport import Outbox, answer_accept
from recap.disagg.zmq_transport import ZmqTransport
from recap.engine.config import EngineConfig
from recap.engine.errors import BusyError
from recap.engine.outputs import RequestOutput
from recap.http.errors import from_exception
from tests.disagg.test_engine_failures import PARAMS, PROMPT, SECRET, assert_clean, decode, drive, make, prefill

HELD: Any = object()  # the outbox never looks inside a held request except to send it


def test_a_hold_nobody_accepts_goes_at_the_accept_deadline() -> None:
    box = Outbox()
    box.publish("t", HELD, deadline=100.0, mac="m", accept_deadline=10.0, client="c")
    assert box.holds("c") == (1, 1) and box.holds("other") == (1, 0)
    assert box.take_due(9.9) == [] and box.take_due(10.0) == ["t"]
    assert box.num_expired == 1 and box.holds("c") == (0, 0)


def test_an_accepted_or_pulled_hold_waits_for_the_hold_deadline() -> None:
    box = Outbox()
    box.publish("a", HELD, deadline=100.0, mac="ma", accept_deadline=10.0)
    box.publish("p", HELD, deadline=100.0, mac="mp", accept_deadline=10.0)
    assert not answer_accept(box, "a", "forged") and not answer_accept(box, "gone", "ma")
    assert answer_accept(box, "a", "ma")
    assert box.claim("p", "mp") is HELD  # a pull accepts too
    box.unclaim("p")
    assert box.take_due(50.0) == []
    assert sorted(box.take_due(100.0)) == ["a", "p"]
    # An accept deadline past the hold deadline changes nothing.
    box.publish("late", HELD, deadline=20.0, mac="m", accept_deadline=30.0)
    assert box.take_due(20.0) == ["late"]


def test_caps_resolve_against_max_num_seqs() -> None:
    secret = b"s" * 16
    assert KVTransferConfig(role="prefill", secret=secret).hold_caps(16) == (8, 8)
    assert KVTransferConfig(role="prefill", secret=secret, max_holds=5, max_holds_per_client=2).hold_caps(16) == (5, 2)
    assert KVTransferConfig(role="prefill", secret=secret, max_holds_per_client=20).hold_caps(3) == (1, 1)
    with pytest.raises(ValueError, match="max_holds"):
        KVTransferConfig(role="prefill", secret=secret, max_holds=-1)


def ask(engine: DisaggLLMEngine, rid: str, client: str) -> Any:
    return drive(engine, dataclasses.replace(engine.prepare(PROMPT, PARAMS, request_id=rid),
                                             kv_transfer=RemoteDecode(client)))


def test_holds_are_capped_per_client_and_in_all(engines: list, config: EngineConfig) -> None:
    pre = make(engines, config, role="prefill", max_holds=3, max_holds_per_client=2, accept_timeout_s=600.0)
    held = [ask(pre, "a1", "10.0.0.1"), ask(pre, "a2", "10.0.0.1")]
    with pytest.raises(BusyError, match="max-holds-per-client") as refused:
        ask(pre, "a3", "10.0.0.1")
    error = from_exception(refused.value)
    assert (error.status, error.type, error.code) == (429, "rate_limit_error", "kv_holds_full")
    held.append(ask(pre, "b1", "10.0.0.2"))  # another client still gets in ...
    with pytest.raises(BusyError, match="--kv-max-holds\\)"):
        ask(pre, "c1", "10.0.0.3")  # ... until all holds are taken
    assert pre.stats.requests_held == 3 and not pre.scheduler.has_unfinished_requests()
    # The decode side takes one of the first client's holds: that client may ask again, and is served.
    dec = make(engines, config, role="decode")
    first = prefill_handle(held[0])
    assert decode(dec, first, "a1").outputs[0].token_ids  # type: ignore[union-attr]
    release_acknowledged(pre)
    assert pre.stats.requests_held == 2
    assert prefill(pre, "a4").transfer_id  # client "" (in process): counted in all, under its own cap
    assert_clean(dec)


def prefill_handle(out: Any) -> RemoteHandle:
    return RemoteHandle.from_params({**out.kv_transfer_params, "do_remote_prefill": True})


def release_acknowledged(pre: DisaggLLMEngine) -> None:
    """Step the prefill engine until the pulled hold is released (the release message is asynchronous)."""
    held = pre.stats.requests_held
    for _ in range(2000):
        if pre.has_unfinished_requests():
            pre.step()
        if pre.stats.requests_held < held:
            return
        time.sleep(0.005)
    raise AssertionError("the pulled hold was not released")


class RecordingTransport(ZmqTransport):
    """The decode side's transport, recording the accepts it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.accepted: list[str] = []

    def accept(self, address: str, transfer_id: str, mac: str) -> None:
        super().accept(address, transfer_id, mac)
        self.accepted.append(transfer_id)


def test_a_decode_side_without_room_accepts_the_handle(engines: list, config: EngineConfig) -> None:
    """A pull that starts at once accepts the hold itself (no accept message); a request that waits for a
    seat sends one, and is served once the seat frees."""
    pre = make(engines, config, role="prefill", accept_timeout_s=600.0)
    one_seat = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=1))
    transport = RecordingTransport()
    dec = DisaggLLMEngine(one_seat, KVTransferConfig(role="decode", secret=SECRET, peers=(pre.address,)), transport)
    engines.append(dec)
    assert isinstance(decode(dec, prefill(pre, "now"), "now"), RequestOutput) and transport.accepted == []
    dec.add_prepared(dec.prepare(PROMPT, dataclasses.replace(PARAMS, max_tokens=3), request_id="local"))
    dec.step()  # the local request takes the only seat
    waiting = prefill(pre, "later")
    local = decode(dec, waiting, "later")  # the local request finishes first ...
    assert isinstance(local, RequestOutput) and local.request_id == "local"
    sent_by = time.monotonic() + 30  # the accept goes out on a notify thread: wait for it (a bound, not a timing)
    while not transport.accepted and time.monotonic() < sent_by:
        time.sleep(0.005)
    assert transport.accepted == [waiting.transfer_id]
    finals: list[RequestOutput] = []
    deadline = time.monotonic() + 60  # a bound for a broken run, not a timing assertion
    while not finals and time.monotonic() < deadline:  # ... then the waiting one pulls and decodes
        finals = [out for out in dec.step() if out.finished]
        if not dec.has_unfinished_requests():
            time.sleep(0.005)  # waiting on the network
    assert finals[0].request_id == "later" and len(finals[0].outputs[0].token_ids) == PARAMS.max_tokens
    assert_clean(dec)
