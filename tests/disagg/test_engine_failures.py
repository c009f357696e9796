"""Transfer failures in process (engines without HTTP): a timeout is a 504 for that request only, a dead
prefill side is a 502 or, with fallback, a local prefill; held KV nobody pulls expires; nothing leaks."""

from __future__ import annotations

import dataclasses
import time

import pytest

from recap.disagg.config import KVTransferConfig, RemoteDecode, RemoteHandle
from recap.disagg.engine import DisaggLLMEngine
from recap.engine.config import EngineConfig
from recap.engine.errors import KVTransferError
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput
from recap.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(7, 47))  # 40 tokens: two full blocks and a partial one


SECRET = b"engine-failures-test-secret"


def make(engines: list[DisaggLLMEngine], config: EngineConfig, **kw: object) -> DisaggLLMEngine:
    """An engine sharing the test secret; a decode engine's peers are the prefill engines made before it."""
    kw.setdefault("secret", SECRET)
    if kw.get("role") == "decode":
        kw.setdefault("peers", tuple(e.address for e in engines if e.address is not None))
    engine = DisaggLLMEngine(config, KVTransferConfig(**kw))  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def drive(engine: LLMEngine, prepared: object, timeout: float = 30.0) -> RequestOutput | BaseException:
    """Run one request to its end: its final output, or the error delivered for it."""
    failures: dict[str, BaseException] = {}
    if isinstance(engine, DisaggLLMEngine):
        engine.bind(lambda: None, failures.__setitem__)
    engine.add_prepared(prepared)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                return out
        if failures:
            return next(iter(failures.values()))
        if not engine.has_unfinished_requests():
            time.sleep(0.005)  # waiting on the network
    raise AssertionError("request did not finish")


def prefill(engine: DisaggLLMEngine, rid: str) -> RemoteHandle:
    out = drive(engine, dataclasses.replace(engine.prepare(PROMPT, PARAMS, request_id=rid), kv_transfer=RemoteDecode()))
    assert isinstance(out, RequestOutput) and out.kv_transfer_params is not None
    assert out.outputs[0].token_ids == [out.kv_transfer_params["first_token_id"]]
    return RemoteHandle.from_params({**out.kv_transfer_params, "do_remote_prefill": True})


def decode(engine: DisaggLLMEngine, handle: RemoteHandle, rid: str) -> RequestOutput | BaseException:
    return drive(engine, dataclasses.replace(engine.prepare(PROMPT, PARAMS, request_id=rid), kv_transfer=handle))


def assert_clean(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    cache = engine.scheduler.cache
    assert cache.kv.pool.num_in_use == 0 and cache.state.pool.num_in_use == 0
    assert not engine.outputs.parents and not engine.scheduler.has_unfinished_requests()


def test_transfer_timeout_is_a_504_and_unpulled_kv_expires(engines: list, config: EngineConfig) -> None:
    pre = make(engines, config, role="prefill", send_delay_s=1.0, hold_timeout_s=1.5)
    dec = make(engines, config, role="decode", transfer_timeout_s=0.3)
    result = decode(dec, prefill(pre, "a"), "a")
    assert isinstance(result, KVTransferError) and result.status == 504 and "timed out" in str(result)
    assert dec.stats.transfers_failed == 1 and dec.stats.transfers_received == 0
    assert_clean(dec)
    assert pre.stats.requests_held == 1 and pre.scheduler.cache.kv.pool.num_in_use == 3
    deadline = time.monotonic() + 10
    while pre.scheduler.remote.held and time.monotonic() < deadline:  # the late send finds nobody: no ack
        if pre.has_unfinished_requests():
            pre.step()
        time.sleep(0.02)
    assert pre.stats.holds_expired == 1 and pre.stats.requests_held == 0
    assert_clean(pre)


@pytest.mark.parametrize("fallback", [False, True])
def test_dead_prefill_instance_is_a_502_or_a_local_prefill(engines: list, config: EngineConfig, fallback: bool) -> None:
    pre = make(engines, config, role="prefill")
    dec = make(engines, config, role="decode", fallback_local_prefill=fallback)
    handle = prefill(pre, "a")
    pre.close()  # the prefill instance is gone before the pull
    result = decode(dec, handle, "a")
    assert dec.stats.transfers_failed == 1
    if not fallback:
        assert isinstance(result, KVTransferError) and result.status == 502 and "cannot reach" in str(result)
    else:
        single = LLMEngine(config)
        expected = drive(single, single.prepare(PROMPT, PARAMS, request_id="a"))
        assert isinstance(result, RequestOutput) and isinstance(expected, RequestOutput)
        assert result.outputs[0].token_ids == expected.outputs[0].token_ids and dec.stats.fallbacks == 1
    assert_clean(dec)


def test_pulled_transfer_registers_and_releases_both_sides(engines: list, config: EngineConfig) -> None:
    pre = make(engines, config, role="prefill")
    dec = make(engines, config, role="decode")
    single = LLMEngine(config)
    result = decode(dec, prefill(pre, "a"), "a")
    expected = drive(single, single.prepare(PROMPT, PARAMS, request_id="a"))
    assert isinstance(result, RequestOutput) and isinstance(expected, RequestOutput)
    assert result.outputs[0].token_ids == expected.outputs[0].token_ids
    s = dec.stats
    # 40 tokens: blocks 0-2 (the last one partial), the running state and the prompt-end checkpoint at 32.
    assert (s.blocks_received, s.states_received, s.checkpoints_registered, s.blocks_local) == (3, 1, 1, 0)
    assert dec.scheduler.cache.kv.pool.num_cached >= 2
    assert_clean(dec)
    deadline = time.monotonic() + 10
    while pre.scheduler.remote.held and time.monotonic() < deadline:  # the ack releases the held request
        if pre.has_unfinished_requests():
            pre.step()
        time.sleep(0.01)
    assert pre.stats.holds_expired == 0
    assert_clean(pre)


def test_a_request_aborted_before_its_pull_releases_the_prefill_side_at_once(engines: list,
                                                                             config: EngineConfig) -> None:
    pre = make(engines, config, role="prefill")  # the hold timeout is 60 s
    dec = make(engines, config, role="decode")
    handle = prefill(pre, "a")
    dec.add_prepared(dataclasses.replace(dec.prepare(PROMPT, PARAMS, request_id="a"), kv_transfer=handle))
    dec.abort_request(["a"])  # before any step: its pull never starts
    deadline = time.monotonic() + 10
    while pre.scheduler.remote.held and time.monotonic() < deadline:  # the decode side's release arrives
        if pre.has_unfinished_requests():
            pre.step()
        time.sleep(0.01)
    assert not pre.scheduler.remote.held and pre.stats.holds_expired == 0 and dec.stats.transfers_in_flight == 0
    assert_clean(pre)
    dec.step()  # delivers the abort
    assert_clean(dec)

