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
from recap.engine.config import EngineConfig
from recap.engine.errors import BusyError
from recap.http.errors import from_exception
from tests.disagg.test_engine_failures import PARAMS, PROMPT, assert_clean, decode, drive, make, prefill

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
