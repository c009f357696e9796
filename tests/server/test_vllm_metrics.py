"""/metrics under vLLM's names: parsed with prometheus_client's parser, names checked against vLLM's own
list (vllm/v1/metrics/loggers.py), values checked against requests the test sends."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from recap.server.vllm_metrics import VLLM_METRIC_NAMES
from tests.server.conftest import MODEL_NAME, wait_idle

# vLLM's metric family names (v1 PrometheusStatLogger), as a dashboard queries them.
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:iteration_tokens_total", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:cache_config_info", "vllm:gpu_cache_usage_perc",
    "vllm:time_per_prefill_token_request_seconds", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
    # the KV offloading connector's (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py)
    "vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes",
}
# What recap measures and must export under those names.
REQUIRED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:cache_config_info",
}


def _families(http: httpx.Client) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def _sample(fams: dict, family: str, sample: str) -> float:
    (value,) = [s.value for s in fams[family].samples if s.name == sample]
    return value


def _labelled(fams: dict, family: str, sample: str, reason: str) -> float:
    (value,) = [s.value for s in fams[family].samples if s.name == sample and s.labels["finished_reason"] == reason]
    return value


def test_vllm_names_parse_and_exist_in_vllm(http: httpx.Client) -> None:
    fams = _families(http)
    vllm = {n for n in fams if n.startswith("vllm:")}
    assert vllm >= REQUIRED, REQUIRED - vllm
    assert vllm <= VLLM_NAMES, vllm - VLLM_NAMES  # no made-up vllm: names
    assert set(VLLM_METRIC_NAMES) == vllm
    for name in vllm - {"vllm:cache_config_info"}:
        for s in fams[name].samples:  # type: ignore[attr-defined]
            assert s.labels.get("model_name") == MODEL_NAME and s.labels.get("engine") == "0", (name, s)
    assert any(n.startswith("recap:checkpoint") for n in fams)  # recap's own series stay


def test_vllm_metrics_follow_the_requests(http: httpx.Client) -> None:
    wait_idle(http)
    before = _families(http)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5,
                                            "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    wait_idle(http)
    after = _families(http)

    def delta(family: str, sample: str) -> float:
        return _sample(after, family, sample) - _sample(before, family, sample)

    assert delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == len(prompt)
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 5
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_count") == 1
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 5
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == len(prompt)
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    success = ("vllm:request_success", "vllm:request_success_total", "length")  # ignore_eos: ends by length
    assert _labelled(after, *success) - _labelled(before, *success) == 1
    usage = _sample(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    assert _sample(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0
