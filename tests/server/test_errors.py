"""Bad input gets a 4xx with an OpenAI error body naming the problem; the server keeps serving."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
OK_CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def c(**kw: Any) -> dict[str, Any]:
    return {**OK_C, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {**OK_CHAT, **kw}


def user(content: Any, **kw: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content, **kw}])


# (id, path, body (bytes: sent raw), status, fragment of the message, param)
CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    ("invalid-json", C, b'{"model": "tiny", "prompt": ', 400, "Invalid JSON", None),
    ("not-an-object", C, b"[1, 2]", 400, "JSON object", None),
    ("unknown-model", C, c(model="gpt-9"), 404, "`gpt-9` does not exist", "model"),
    ("extra-fields", C, c(foo=1, bar=2), 400, "Unsupported field(s): foo, bar", "foo"),
    ("nested-extra-field", CHAT, user("Hi", foo=[]), 400, "Unsupported field(s): messages[0].foo",
     "messages[0].foo"),
    ("tool-calls-on-user", CHAT, user("Hi", tool_calls=[]), 400, "tool_calls: only assistant messages carry them",
     "messages[0]"),
    ("missing-prompt", C, {"model": MODEL_NAME}, 400, "prompt: Field required", "prompt"),
    ("negative-max-tokens", C, c(max_tokens=-5), 400, "max_tokens must be at least 1", "max_tokens"),
    ("absurd-max-tokens", C, c(max_tokens=10**12), 400, f"maximum context length is {MAX_MODEL_LEN}",
     "max_tokens"),
    ("prompt-too-long", C, c(prompt=[7] * (MAX_MODEL_LEN + 5)), 400, "maximum context length", "prompt"),
    ("out-of-vocab", C, c(prompt=[1, 2, 99999]), 400, "token id 99999 is out of vocabulary", "prompt"),
    ("negative-token", C, c(prompt=[-1]), 400, "token id -1 is out of vocabulary", "prompt"),
    ("batch-prompt-out-of-vocab", C, c(prompt=[[1, 2], [3, 99999]]), 400, "prompt 1: token id 99999", "prompt"),
    ("n-too-large", C, c(n=1000), 400, "n: 1000 choices asked, at most 16", "n"),
    ("wrong-type-temperature", C, c(temperature="hot"), 400, "temperature: Input should be a valid number",
     "temperature"),
    ("wrong-type-n", C, c(n="2"), 400, "n: Input should be a valid integer", "n"),
    ("wrong-type-stop", C, c(stop=3), 400, "stop: Input should be a valid string", "stop"),
    ("wrong-type-user", C, c(user=5), 400, "user: Input should be a valid string", "user"),
    ("negative-temperature", C, c(temperature=-1), 400, "temperature must be >= 0", "temperature"),
    ("bad-top-p", C, c(top_p=0), 400, "top_p must be in (0, 1]", "top_p"),
    ("too-many-logprobs", C, c(logprobs=50), 400, "logprobs must be between 0 and 20", "logprobs"),
    ("empty-prompt", C, c(prompt=""), 400, "prompt must not be empty", "prompt"),
    ("empty-prompt-list", C, c(prompt=[]), 400, "prompt must not be empty", "prompt"),
    ("mixed-prompt-list", C, c(prompt=["a", 1]), 400, "prompt must be a string, a list of token ids", "prompt"),
    ("max-tokens-zero-without-echo", C, c(max_tokens=0), 400, "max_tokens must be at least 1 (0 only with echo)",
     "max_tokens"),
    ("suffix", C, c(suffix="x"), 400, "suffix is not supported", "suffix"),
    ("best-of", C, c(best_of=3), 400, "best_of is not supported (only equal to n)", "best_of"),
    ("beam-search", C, c(use_beam_search=True), 400, "use_beam_search is not supported", "use_beam_search"),
    ("length-penalty", CHAT, chat(length_penalty=0.8), 400, "length_penalty is not supported", "length_penalty"),
    ("echo-type", C, c(echo="yes"), 400, "echo: Input should be a valid boolean", "echo"),
    ("chat-both-render-flags", CHAT, chat(continue_final_message=True), 400, "cannot both be true",
     "continue_final_message"),
    ("chat-store", CHAT, chat(store=True), 400, "store is not supported (only false", "store"),
    ("chat-service-tier", CHAT, chat(service_tier="flex"), 400, "service_tier: Input should be 'auto' or 'default'",
     "service_tier"),
    ("chat-audio-modality", CHAT, chat(modalities=["text", "audio"]), 400, "Input should be 'text'", "modalities[1]"),
    ("chat-metadata-values", CHAT, chat(metadata={"n": 1}), 400, "metadata.n: Input should be a valid string",
     "metadata.n"),
    ("frequency-penalty", C, c(frequency_penalty=2.5), 400, "frequency_penalty must be in [-2, 2]",
     "frequency_penalty"),
    ("presence-penalty", CHAT, chat(presence_penalty=-3), 400, "presence_penalty must be in [-2, 2]",
     "presence_penalty"),
    ("repetition-penalty", C, c(repetition_penalty=0), 400, "repetition_penalty must be in (0, 2]",
     "repetition_penalty"),
    ("logit-bias-key", C, c(logit_bias={"x": 1.0}), 400, "logit_bias: key 'x' is not a token id", "logit_bias"),
    ("logit-bias-value", C, c(logit_bias={"5": 101}), 400, "logit_bias: the bias of token 5 must be in",
     "logit_bias"),
    ("logit-bias-out-of-vocab", CHAT, chat(logit_bias={"99999": 1}), 400, "logit_bias: token id 99999 is out of",
     "logit_bias"),
    ("prompt-logprobs", C, c(prompt_logprobs=21), 400, "prompt_logprobs must be between 0 and 20",
     "prompt_logprobs"),
    ("min-p", C, c(min_p=1.5), 400, "min_p must be in [0, 1]", "min_p"),
    ("top-k", CHAT, chat(top_k=-2), 400, "top_k must be -1, 0 or positive", "top_k"),
    ("ignore-eos-type", C, c(ignore_eos="no"), 400, "ignore_eos: Input should be a valid boolean", "ignore_eos"),
    ("skip-special-type", C, c(skip_special_tokens=3), 400, "skip_special_tokens: Input should be a valid boolean",
     "skip_special_tokens"),
    ("include-stop-str-type", C, c(include_stop_str_in_output="x"), 400,
     "include_stop_str_in_output: Input should be a valid boolean", "include_stop_str_in_output"),
    ("include-usage-type", C, c(stream=True, stream_options={"include_usage": 2}), 400,
     "stream_options.include_usage: Input should be a valid boolean", "stream_options.include_usage"),
    ("parallel-tool-calls-type", CHAT, chat(parallel_tool_calls="x"), 400,
     "parallel_tool_calls: Input should be a valid boolean", "parallel_tool_calls"),
    ("negative-min-tokens", C, c(min_tokens=-1), 400, "min_tokens must be >= 0", "min_tokens"),
    ("stop-token-ids-type", C, c(stop_token_ids=["a"]), 400, "stop_token_ids[0]: Input should be a valid integer",
     "stop_token_ids[0]"),
    ("seed-type", C, c(seed="x"), 400, "seed: Input should be a valid integer", "seed"),
    ("seed-over-int64", CHAT, chat(seed=2**64), 400, "seed must be a signed 64-bit integer", "seed"),
    ("continuous-usage-type", C, c(stream=True, stream_options={"continuous_usage_stats": "yes"}), 400,
     "stream_options.continuous_usage_stats: Input should be a valid boolean",
     "stream_options.continuous_usage_stats"),
    ("spaces-between-special-tokens", C, c(spaces_between_special_tokens=False), 400,
     "spaces_between_special_tokens is not supported", "spaces_between_special_tokens"),
    ("stream-options-without-stream", C, c(stream_options={"include_usage": True}), 400,
     "stream_options is only allowed when stream is true", "stream_options"),
    ("checkpoint-outside-prompt", C, c(prompt=[5, 6, 7], checkpoints=[2, 9]), 400,
     "checkpoints: offset 9 is outside the prompt", "checkpoints"),
    ("stop-token-out-of-vocab", C, c(stop_token_ids=[100000]), 400, "stop token id 100000 is out of vocabulary",
     "stop_token_ids"),
    ("min-tokens-over-max", C, c(min_tokens=5), 400, "min_tokens must not exceed max_tokens", "min_tokens"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages must not be empty", "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'", "messages[0].role"),
    ("user-without-content", CHAT, chat(messages=[{"role": "user"}]), 400, "a user message needs content",
     "messages[0]"),
    ("image-part", CHAT, user([{"type": "image_url", "image_url": {"url": "http://x"}}]), 400,
     "only text content parts are supported, got type 'image_url'", "messages[0].content"),
    ("bad-cache-control", CHAT, user("Hi", cache_control={"type": "persistent"}), 400,
     "messages[0].cache_control.type: Input should be 'ephemeral'", "messages[0].cache_control.type"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs requires logprobs",
     "top_logprobs"),
    ("tool-without-type", CHAT, chat(tools=[{"function": {"name": "f"}}]), 400, "tools[0].type: Field required",
     "tools[0].type"),
    ("tool-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools[0].function.name: String should match pattern", "tools[0].function.name"),
    ("tool-choice-unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice: no tool named 'g'", "tool_choice"),
    ("tool-choice-without-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice: needs tools", "tool_choice"),
    ("tool-choice-bad", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
     400, "tool_choice", "tool_choice"),
    ("tool-choice-auto-no-parser", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "needs a tool call parser", "tool_choice"),
    ("response-format-type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type: Input should be",
     "response_format.type"),
    ("response-format-no-schema", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format: type json_schema needs json_schema.schema", "response_format"),
    ("guided-regex", C, c(guided_regex="(unclosed"), 400, "guided_regex: invalid regex", "guided_regex"),
    ("guided-json", C, c(guided_json="{nope"), 400, "guided_json: not valid JSON", "guided_json"),
    ("guided-choice", C, c(guided_choice=[]), 400, "guided_choice: must be a non-empty list", "guided_choice"),
    ("guided-grammar", CHAT, chat(guided_grammar="start: missing"), 400, "guided_grammar: invalid grammar",
     "guided_grammar"),
    ("two-constraints", C, c(guided_regex="a", guided_choice=["b"]), 400, "only one output constraint",
     "guided_choice"),
    ("structured-outputs-empty", C, c(structured_outputs={}), 400, "structured_outputs: give one of",
     "structured_outputs"),
    ("structured-outputs-unknown", C, c(structured_outputs={"xml": "x"}), 400,
     "Unsupported field(s): structured_outputs.xml", "structured_outputs.xml"),
    ("forced-tool-and-format", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                          tool_choice="required", response_format={"type": "json_object"}), 400,
     "tool_choice: a forced tool call cannot be combined with response_format", "tool_choice"),
    ("max-tokens-disagree", CHAT, chat(max_tokens=3, max_completion_tokens=4), 400,
     "max_tokens and max_completion_tokens disagree", "max_tokens"),
    ("chat-n-too-large", CHAT, chat(n=17), 400, "n: 17 choices asked, at most 16", "n"),
]


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_it(
    http: httpx.Client, path: str, body: Any, status: int, fragment: str, param: str | None
) -> None:
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_unknown_route_and_method_are_openai_errors(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = http.get(C)
    assert r.status_code == 405 and "error" in r.json()


def test_bad_requests_do_not_disturb_accepted_ones(http: httpx.Client, server: Any) -> None:
    """A long streamed request runs while every bad request is rejected; it completes in full."""
    body = chat(max_tokens=120, stream=True, temperature=0.0, ignore_eos=True,
                stream_options={"include_usage": True})
    events: list[str] = []

    def run() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as h, h.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=run)
    t.start()
    for _, path, bad, status, _, _ in CASES:
        r = http.post(path, content=bad) if isinstance(bad, bytes) else http.post(path, json=bad)
        assert r.status_code == status
    t.join(timeout=120)
    assert events[-1] == "data: [DONE]"
    assert '"completion_tokens":120' in events[-2]
    ok = http.post(C, json=c(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3



def test_fields_at_values_with_no_effect_are_accepted(http: httpx.Client) -> None:
    """What clients send at their defaults (vLLM's bench, lm-eval, LangChain, guidellm) changes nothing: 200."""
    neutral = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {},
               "min_p": 0.0, "top_k": -1, "min_tokens": 0, "stop_token_ids": [], "seed": None, "n": 1,
               "use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True,
               "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "ignore_eos": False,
               "prompt_logprobs": None, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    for path, body in ((C, c(**neutral, best_of=1, echo=False, suffix="", logprobs=None)),
                       (CHAT, chat(**neutral, echo=False, logprobs=False, tool_choice="none",
                                   parallel_tool_calls=True, store=False, metadata={"team": "a"}, service_tier="auto",
                                   modalities=["text"], prompt_cache_key="k1", safety_identifier="u-1",
                                   add_generation_prompt=True, continue_final_message=False))):
        r = http.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


def test_null_fields_mean_their_default(http: httpx.Client) -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": None,
             "frequency_penalty": None, "presence_penalty": None, "logit_bias": None, "user": None}
    r = http.post(C, json=c(**nulls))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    r = http.post(CHAT, json=chat(**nulls, logprobs=None, max_tokens=None, max_completion_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
