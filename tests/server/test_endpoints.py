"""vLLM's utility endpoints and HTTP behaviours: /tokenize, /detokenize, /version, /v1/models/{id},
X-Request-Id, per-response `created`, CORS; the flags that configure them; generation_config defaults."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import recap
from recap import cli
from recap.engine.async_engine import AsyncEngine
from recap.launch.engine_args import engine_config, read_chat_template
from recap.server.app import build_app
from recap.server.options import ServerOptions, server_options
from recap.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "The pump and the valve",
                                     "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    assert "".join(body["token_strs"]) == "The pump and the valve"
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "The pump and the valve"}
    # the chat form counts what /v1/chat/completions would compute
    msgs = [{"role": "user", "content": "Hi"}]
    chat_ids = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    usage = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()["usage"]
    assert len(chat_ids) == usage["prompt_tokens"]


@pytest.mark.parametrize(("path", "body", "fragment", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of", None),
    ("/tokenize", {"prompt": 5}, "prompt: Input should be a valid string", "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist", "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     "cannot both be true", "continue_final_message"),
    ("/detokenize", {"tokens": [1, 10**7]}, "token id 10000000 is out of vocabulary", "tokens"),
    ("/detokenize", {"tokens": []}, "tokens: List should have at least 1 item", "tokens"),
    ("/detokenize", {"tokens": [1], "extra": 1}, "Unsupported field(s): extra", "extra"),
])
def test_utility_endpoints_reject_bad_input(http: httpx.Client, path: str, body: dict, fragment: str,
                                            param: str | None) -> None:
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param, err


def test_version_model_card_request_id_and_created(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": recap.__version__}
    card = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["max_model_len"] == MAX_MODEL_LEN
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    before = int(time.time())
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1"
    assert before <= r.json()["created"] <= int(time.time()) + 1
    with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "abc-2"},
                     json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}) as s:
        assert s.headers["x-request-id"] == "abc-2"
        s.read()
    assert "x-request-id" not in http.get("/health").headers


def test_cors_only_when_origins_are_set(server: object) -> None:
    engine = server.server.config.app.state.recap.engine  # type: ignore[attr-defined]
    assert isinstance(engine, AsyncEngine)
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    on = TestClient(build_app(engine, shutdown_engine=False, options=ServerOptions(allowed_origins=("*",))))
    r = on.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    off = TestClient(build_app(engine, shutdown_engine=False))
    assert "access-control-allow-origin" not in off.options("/v1/completions", headers=preflight).headers


def test_vllm_serve_flags(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = cli.build_parser().parse_args([
        "serve", "m", "--dtype", "auto", "--mamba-cache-mode", "align", "--generation-config", "vllm",
        "--chat-template", str(template), "--allowed-origins", '["http://a"]', "--uvicorn-log-level", "warning",
        "--served-model-name", "alias", "--max-n", "4"])
    cfg = engine_config(args)
    assert cfg.dtype == "float32" and cfg.cache.checkpoint_policy == "align" and cfg.generation_config == "vllm"
    assert cfg.chat_template == template.read_text() and cfg.served_model_name == "alias" and cfg.max_n == 4
    assert cfg.derive_max_model_len  # no --max-model-len: the model config's length
    assert server_options(args).allowed_origins == ("http://a",) and args.uvicorn_log_level == "warning"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="chat_template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="disagree"):
        engine_config(cli.build_parser().parse_args(["serve", "--mamba-cache-mode", "all", "--checkpoint-policy",
                                                      "none"]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--allowed-origins", "*"])


def test_generation_config_fills_only_unset_fields() -> None:
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7, "repetition_penalty": 1.1}
    c = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.9}).sampling_params(defaults)
    assert (c.temperature, c.top_k, c.max_tokens, c.repetition_penalty) == (0.9, 5, 7, 1.1)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 3}).sampling_params(defaults)
    assert (chat.temperature, chat.max_tokens) == (0.3, 3)


PREFILLED = [{"role": "user", "content": "Name a pump part"}, {"role": "assistant", "content": "The valve and the"}]


def test_continue_final_message_prefills_the_answer(http: httpx.Client, tiny_model: Path) -> None:
    """vLLM's chat flags: add_generation_prompt false + continue_final_message true renders the prefilled
    assistant turn open (transformers' ids); echo puts it before each choice's content, streamed or not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    want = tok.apply_chat_template(PREFILLED, tokenize=True, add_generation_prompt=False, continue_final_message=True,
                                   return_dict=False)  # fmt: skip
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = http.post("/tokenize", json={"messages": PREFILLED, **flags}).json()["tokens"]
    assert ids == list(want)
    closed = http.post("/tokenize", json={"messages": PREFILLED, "add_generation_prompt": False}).json()["tokens"]
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # the open turn stops before the end-of-turn
    body = {"messages": PREFILLED, "max_tokens": 6, "temperature": 0.0, **flags}
    plain = http.post("/v1/chat/completions", json=body).json()
    assert plain["usage"]["prompt_tokens"] == len(ids)
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "The valve and the" + text
    parts = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                parts.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert parts[:2] == ["", "The valve and the"] and "".join(parts) == "The valve and the" + text
    # echo after a generation prompt: the last message is the user's, not the answer's role: nothing is echoed
    asked = http.post("/v1/chat/completions", json={"messages": PREFILLED[:1], "max_tokens": 4, "temperature": 0.0,
                                                    "echo": True}).json()  # fmt: skip
    again = http.post("/v1/chat/completions", json={"messages": PREFILLED[:1], "max_tokens": 4,
                                                    "temperature": 0.0}).json()  # fmt: skip
    assert asked["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


def test_chat_flags_that_cannot_hold_together_are_a_400_and_an_empty_open_turn(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": PREFILLED, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"], r.text
    # an empty assistant turn left open is the generation prompt itself (with this template)
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    open_turn = http.post("/tokenize", json={"messages": empty, "continue_final_message": True,
                                             "add_generation_prompt": False}).json()["tokens"]  # fmt: skip
    assert open_turn == http.post("/tokenize", json={"messages": empty[:1]}).json()["tokens"]
