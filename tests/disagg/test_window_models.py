"""Disaggregation of models with sliding-window attention layers, in process (engines without HTTP): LFM3 (short
convs + full and sliding-window attention) and RecurrentGemma (RG-LRU + local attention, no full-attention group).
Block size 4 against a window of 12 tokens: the window spans 3 blocks, so the transfer carries several window
blocks and the decode side's table starts with a null run.

The decode side's greedy tokens equal a single instance's; the window blocks it received are registered, so the
next request sharing the prompt hits on the decode side itself; a transfer whose window part is malformed or
mismatched is refused whole and, with fallback, prefilled locally to the same tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from recap.disagg.config import KVTransferConfig, RemoteDecode, RemoteHandle
from recap.disagg.engine import DisaggLLMEngine
from recap.disagg.zmq_transport import ZmqTransport
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput
from tests.disagg.test_engine_failures import PARAMS, SECRET, drive
from tests.engine.conftest import tiny_model_dir
from tests.server.conftest import engine_config

PROMPT = list(range(7, 47))  # 40 tokens: 10 blocks of 4
LONGER = PROMPT + list(range(300, 310))  # shares all 40
ARCHS = ("lfm3", "recurrent_gemma")


@pytest.fixture(scope="module", params=ARCHS)
def window_config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return engine_config(tiny_model_dir(tmp_path_factory.mktemp("window"), request.param), block_size=4)


class TamperingTransport(ZmqTransport):
    """The pyzmq transport whose pulls hand the decode side a reply altered by `tamper` (header, frames)."""

    def __init__(self, tamper: Callable[[dict[str, Any], list[Any]], None]) -> None:
        super().__init__("127.0.0.1", 0)
        self.tamper = tamper

    def pull(self, address: str, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], Sequence[Any]]:
        reply, frames = super().pull(address, header, timeout_s)
        frames = list(frames)
        self.tamper(reply, frames)
        return reply, frames


@pytest.fixture()
def made() -> Iterator[list[DisaggLLMEngine]]:
    engines: list[DisaggLLMEngine] = []
    yield engines
    for e in engines:
        e.close()


def pair(made: list[DisaggLLMEngine], config: EngineConfig, transport: ZmqTransport | None = None,
         **decode: Any) -> tuple[DisaggLLMEngine, DisaggLLMEngine]:
    pre = DisaggLLMEngine(config, KVTransferConfig(role="prefill", secret=SECRET))
    made.append(pre)
    assert pre.address is not None
    dec = DisaggLLMEngine(config, KVTransferConfig(role="decode", secret=SECRET, peers=(pre.address,), **decode),
                          transport)
    made.append(dec)
    return pre, dec


def through(pre: DisaggLLMEngine, dec: DisaggLLMEngine, prompt: list[int], rid: str) -> RequestOutput:
    """Prefill on `pre`, decode on `dec`: the decode side's final output."""
    first = drive(pre, dataclasses.replace(pre.prepare(prompt, PARAMS, request_id=rid), kv_transfer=RemoteDecode()))
    assert isinstance(first, RequestOutput) and first.kv_transfer_params is not None
    assert first.kv_transfer_params["window_start"] is not None
    handle = RemoteHandle.from_params({**first.kv_transfer_params, "do_remote_prefill": True})
    out = drive(dec, dataclasses.replace(dec.prepare(prompt, PARAMS, request_id=rid), kv_transfer=handle))
    assert isinstance(out, RequestOutput), out
    return out


def single_tokens(config: EngineConfig, *prompts: list[int]) -> list[RequestOutput]:
    single = LLMEngine(config)
    outs = [drive(single, single.prepare(p, PARAMS, request_id=f"s{i}")) for i, p in enumerate(prompts)]
    assert all(isinstance(o, RequestOutput) for o in outs)
    return outs  # type: ignore[return-value]


def settle(pre: DisaggLLMEngine, timeout: float = 30.0) -> None:
    """Step the prefill side until the decode side's release freed its hold (by the clock: a loaded box's
    notify thread may take a while, and steps can come faster than it)."""
    deadline = time.monotonic() + timeout
    while pre.scheduler.remote.held:
        assert time.monotonic() < deadline, "the prefill side still holds a request"
        if pre.has_unfinished_requests():
            pre.step()
        time.sleep(0.005)


def assert_clean(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    cache = engine.scheduler.cache
    for pool in (cache.kv.pool if cache.kv else None, cache.window.pool if cache.window else None):
        assert pool is None or pool.num_in_use == 0
    assert cache.state is None or cache.state.pool.num_in_use == 0
    assert not engine.scheduler.has_unfinished_requests()


def test_decode_equals_a_single_instance_and_hits_its_own_cache(made: list, window_config: EngineConfig) -> None:
    pre, dec = pair(made, window_config)
    assert dec.scheduler.cache.window is not None
    expected_a, expected_b = single_tokens(window_config, PROMPT, LONGER)
    a = through(pre, dec, PROMPT, "a")
    assert a.outputs[0].token_ids == expected_a.outputs[0].token_ids
    assert dec.stats.window_blocks_received >= 3 and dec.stats.transfers_received == 1
    window = dec.scheduler.cache.window
    assert window.pool.num_cached >= 3  # the received window blocks are findable by hash
    b = through(pre, dec, LONGER, "b")
    assert b.outputs[0].token_ids == expected_b.outputs[0].token_ids
    # The decode side's own hit on what it registered from "a": at least a single instance's (the prefill side
    # also offered its state after all 40 prompt tokens, which a single instance never checkpoints).
    assert b.num_cached_tokens >= expected_b.num_cached_tokens > 0
    local = drive(dec, dec.prepare(LONGER, PARAMS, request_id="c"))  # no transfer at all: a plain hit
    assert isinstance(local, RequestOutput) and local.num_cached_tokens >= 40
    assert local.outputs[0].token_ids == expected_b.outputs[0].token_ids
    settle(pre)
    assert_clean(dec)
    assert_clean(pre)


def _bad_hash(reply: dict[str, Any], frames: list[Any]) -> None:
    reply["window_blocks"][0]["hash"] = "0" * 32


def _old_format(reply: dict[str, Any], frames: list[Any]) -> None:
    reply["format"] = 1


def _other_blocks(reply: dict[str, Any], frames: list[Any]) -> None:
    reply["window_blocks"] = reply["window_blocks"][1:]


def _no_window_layers(reply: dict[str, Any], frames: list[Any]) -> None:
    reply["window_layers"] = []


def _short_rows(reply: dict[str, Any], frames: list[Any]) -> None:
    """A window tensor whose header and frame both claim one block fewer (sizes agree, the plan does not)."""
    i = next(j for j, m in enumerate(reply["tensors"]) if m["name"].startswith("window."))
    meta = reply["tensors"][i]
    per_block = len(frames[i]) // meta["shape"][1]
    frames[i] = bytes(frames[i])[: per_block * (meta["shape"][1] - 1)]
    meta["shape"][1] -= 1


@pytest.mark.parametrize("tamper", [_bad_hash, _old_format, _other_blocks, _no_window_layers, _short_rows])
def test_a_malformed_window_transfer_falls_back_to_local_prefill(made: list, window_config: EngineConfig,
                                                                 tamper: Callable) -> None:
    pre, dec = pair(made, window_config, TamperingTransport(tamper), fallback_local_prefill=True)
    expected = single_tokens(window_config, PROMPT)[0]
    out = through(pre, dec, PROMPT, "a")
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert dec.stats.transfers_failed == 1 and dec.stats.fallbacks == 1 and dec.stats.transfers_received == 0
    assert dec.scheduler.cache.window.pool.num_cached > 0  # what the local prefill computed, not the bad data
    settle(pre)
    assert_clean(dec)
    assert_clean(pre)


def test_a_window_model_and_a_windowless_one_refuse_each_others_handles(made: list, window_config: EngineConfig,
                                                                         tmp_path: Path) -> None:
    """The handle says whether the model has window layers: a decode side of another model refuses it (502)."""
    from recap.engine.errors import KVTransferError

    pre = DisaggLLMEngine(window_config, KVTransferConfig(role="prefill", secret=SECRET))
    made.append(pre)
    other = engine_config(tiny_model_dir(tmp_path, "bamba"), block_size=4)
    dec = DisaggLLMEngine(other, KVTransferConfig(role="decode", secret=SECRET, peers=(pre.address,)))
    made.append(dec)
    first = drive(pre, dataclasses.replace(pre.prepare(PROMPT, PARAMS, request_id="a"), kv_transfer=RemoteDecode()))
    assert isinstance(first, RequestOutput) and first.kv_transfer_params is not None
    handle = RemoteHandle.from_params({**first.kv_transfer_params, "do_remote_prefill": True})
    with pytest.raises(KVTransferError, match="sliding-window layers, this side does not"):
        dec.add_prepared(dataclasses.replace(dec.prepare(PROMPT, PARAMS, request_id="a"), kv_transfer=handle))
    settle(pre)
    assert_clean(pre)


def test_with_fallback_a_handle_this_side_cannot_resume_is_prefilled_here(made: list, window_config: EngineConfig,
                                                                          tmp_path: Path) -> None:
    """`--fallback-local-prefill`: a handle the decode side refuses (another model's window layout; a prefill
    side of another version mid-upgrade) costs a local prefill, not a 502: the answer is this side's own, the
    prefill side's hold is released at once."""
    pre = DisaggLLMEngine(window_config, KVTransferConfig(role="prefill", secret=SECRET))
    made.append(pre)
    other = engine_config(tiny_model_dir(tmp_path, "bamba"), block_size=4)
    dec = DisaggLLMEngine(other, KVTransferConfig(role="decode", secret=SECRET, peers=(pre.address,),
                                                  fallback_local_prefill=True))  # fmt: skip
    made.append(dec)
    first = drive(pre, dataclasses.replace(pre.prepare(PROMPT, PARAMS, request_id="a"), kv_transfer=RemoteDecode()))
    assert isinstance(first, RequestOutput) and first.kv_transfer_params is not None
    handle = RemoteHandle.from_params({**first.kv_transfer_params, "do_remote_prefill": True})
    out = drive(dec, dataclasses.replace(dec.prepare(PROMPT, PARAMS, request_id="a"), kv_transfer=handle))
    assert isinstance(out, RequestOutput)
    assert out.outputs[0].token_ids == single_tokens(other, PROMPT)[0].outputs[0].token_ids
    assert dec.stats.fallbacks == 1 and dec.stats.transfers_received == 0
    settle(pre)
    assert_clean(pre)
    assert_clean(dec)
