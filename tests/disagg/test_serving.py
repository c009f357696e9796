"""Prefill, decode and proxy as three processes: outputs, usage and hit rates equal a single instance's;
a shared prefix is not sent twice; a prefill instance killed mid-transfer fails only its request."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.disagg.conftest import MODEL_NAME, Cluster, metric, wait_idle

TIMEOUT = 120


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL_NAME, **body}, timeout=TIMEOUT)


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Text and usage of a streamed response (completions or chat)."""
    text, usage = "", None
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL_NAME, "stream": True,
                                                   "stream_options": {"include_usage": True}, **body},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, usage


def answer(r: httpx.Response) -> tuple[str, dict[str, Any]]:
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return choice.get("text", choice.get("message", {}).get("content")), body["usage"]


COMPLETION = {"prompt": "The quick brown fox jumps over the lazy dog. " * 6, "max_tokens": 24, "temperature": 0,
              "ignore_eos": True}
CHAT = {"messages": [{"role": "system", "content": "You are terse. " * 8},
                     {"role": "user", "content": "Name three colours, then three animals."}],
        "max_tokens": 20, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_greedy_outputs_and_usage_equal_a_single_instance(cluster: Cluster, path: str, body: dict) -> None:
    plain_single = answer(post(cluster.single.url, path, body))
    plain_disagg = answer(post(cluster.proxy.url, path, body))
    assert plain_disagg == plain_single  # text and usage, cached_tokens included
    streamed_single, streamed_disagg = stream(cluster.single.url, path, body), stream(cluster.proxy.url, path, body)
    assert streamed_disagg == streamed_single
    assert streamed_disagg[0] == plain_disagg[0] and streamed_disagg[1]["completion_tokens"] == body["max_tokens"]
    # The repeated prompt hits on the decode side exactly as on the single instance.
    assert streamed_disagg[1]["prompt_tokens_details"]["cached_tokens"] > 0


def test_multi_turn_hit_rate_equals_a_single_instance(cluster: Cluster) -> None:
    def counters(url: str) -> tuple[float, float]:
        return metric(url, "recap:prefix_cache_queries_total"), metric(url, "recap:prefix_cache_hits_total")

    before = {"single": counters(cluster.single.url), "decode": counters(cluster.decode.url)}
    histories = {"single": "A long conversation starts here. " * 5, "decode": "A long conversation starts here. " * 5}
    cached: dict[str, list[int]] = {"single": [], "decode": []}
    for turn in range(4):
        for side, url in (("single", cluster.single.url), ("decode", cluster.proxy.url)):
            text, usage = answer(post(url, "/v1/completions", {"prompt": histories[side], "max_tokens": 20,
                                                               "temperature": 0, "ignore_eos": True}))
            cached[side].append(usage["prompt_tokens_details"]["cached_tokens"])
            histories[side] += text + f" Turn {turn}: and what happened next?"
    assert histories["decode"] == histories["single"]
    assert cached["decode"] == cached["single"] and sum(cached["single"]) > 0
    after = {"single": counters(cluster.single.url), "decode": counters(cluster.decode.url)}
    rates = {s: (after[s][1] - before[s][1]) / (after[s][0] - before[s][0]) for s in after}
    print(f"multi-turn hit rate: single {rates['single']:.3f}, disaggregated (decode side) {rates['decode']:.3f}")
    assert rates["decode"] == rates["single"] > 0.3


def test_a_shared_prefix_is_not_sent_again(cluster: Cluster) -> None:
    decode, prefill = cluster.decode.url, cluster.prefill.url
    names = ("recap:disagg_blocks_received_total", "recap:disagg_bytes_received_total",
             "recap:disagg_blocks_local_total", "recap:disagg_checkpoints_registered_total")
    shared = " ".join(f"item{i}" for i in range(60))
    deltas = []
    for tail in (" first question?", " a different, second question?"):
        start = [metric(decode, n) for n in names]
        answer(post(cluster.proxy.url, "/v1/completions", {"prompt": shared + tail, "max_tokens": 4, "temperature": 0}))
        deltas.append([metric(decode, n) - s for n, s in zip(names, start)])
    (blocks1, bytes1, local1, ckpt1), (blocks2, bytes2, local2, ckpt2) = deltas
    print(f"first request: {blocks1:.0f} blocks, {bytes1:.0f} bytes ({ckpt1:.0f} checkpoints registered); "
          f"second: {blocks2:.0f} blocks, {bytes2:.0f} bytes, {local2:.0f} blocks already held")
    assert local1 == 0 and ckpt1 >= 1 and local2 >= 1
    assert 0 < blocks2 < blocks1 and bytes2 < bytes1
    assert metric(prefill, "recap:disagg_blocks_sent_total") >= blocks1 + blocks2


def test_disaggregation_fields_are_checked(cluster: Cluster) -> None:
    bad = [
        (cluster.single.url, {"kv_transfer_params": {"do_remote_decode": True}}, "single instance"),
        (cluster.proxy.url, {"kv_transfer_params": {"do_remote_decode": True}}, "set by the proxy"),
        (cluster.proxy.url, {"n": 2}, "n = 1"),
        (cluster.proxy.url, {"logprobs": 1}, "logprobs"),
        (cluster.decode.url, {"kv_transfer_params": {"do_remote_prefill": True}}, "remote_address"),
    ]
    for url, extra, words in bad:
        r = post(url, "/v1/completions", {"prompt": "hello there", "max_tokens": 2, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (url, extra, r.text)


def test_instances_leak_nothing(cluster: Cluster) -> None:
    for inst in (cluster.prefill, cluster.decode, cluster.single):
        report = wait_idle(inst.url)
        assert report["ok"], report
    assert metric(cluster.prefill.url, "recap:disagg_requests_held") == 0
    assert metric(cluster.decode.url, "recap:disagg_transfers_failed_total") == 0


def test_killed_prefill_fails_only_its_request(cluster: Cluster) -> None:
    """The slow prefill instance delays every send by 5 s: kill it while the decode side waits for one."""
    proxy, decode = cluster.slow_proxy.url, cluster.decode.url
    long_body = {"model": MODEL_NAME, "prompt": "Count with me: one two three", "max_tokens": 400,
                 "temperature": 0, "ignore_eos": True, "stream": True}
    long_result: dict[str, Any] = {}
    started = threading.Event()

    def run_long() -> None:
        tokens, finish = 0, None
        with httpx.stream("POST", f"{proxy}/v1/completions", json=long_body, timeout=TIMEOUT) as r:
            long_result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    for c in event.get("choices", []):
                        tokens += 1 if c.get("text") else 0
                        finish = c.get("finish_reason") or finish
                    started.set()
        long_result.update(events=tokens, finish=finish)

    long_thread = threading.Thread(target=run_long)
    long_thread.start()
    assert started.wait(TIMEOUT), "the long request never started decoding"
    failed_before = metric(decode, "recap:disagg_transfers_failed_total")
    result: dict[str, httpx.Response] = {}
    victim = threading.Thread(target=lambda: result.update(r=post(proxy, "/v1/completions",
                                                                  {"prompt": "This one dies.", "max_tokens": 8})))
    victim.start()
    for _ in range(600):  # wait until the decode side is pulling (the prefill side sits in its send delay)
        if metric(decode, "recap:disagg_transfers_in_flight") >= 1:
            break
        threading.Event().wait(0.01)
    assert metric(decode, "recap:disagg_transfers_in_flight") >= 1
    cluster.slow_prefill.proc.kill()
    victim.join(TIMEOUT)
    r = result["r"]
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "went away" in error["message"]
    long_thread.join(TIMEOUT)
    assert long_result["status"] == 200 and long_result["finish"] == "length" and long_result["events"] > 0
    assert metric(decode, "recap:disagg_transfers_failed_total") == failed_before + 1
    report = wait_idle(decode)
    assert report["ok"] and report["pools"]["kv_blocks_in_use"] == report["pools"]["state_slots_in_use"] == 0
    # With the prefill instance gone, the proxy answers 502 itself.
    r = post(proxy, "/v1/completions", {"prompt": "Anyone there?", "max_tokens": 2})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
