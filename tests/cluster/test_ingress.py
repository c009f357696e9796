"""The ingress tokenizes a request exactly as the replica that will serve it does (the router hashes that)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.sampling_params import SamplingParams  # noqa: E402
from recap.server.chat_prompt import build_chat_input  # noqa: E402
from recap.server.protocol import ChatMessage  # noqa: E402
from recap.server.routing_prompt import prompt_tokens  # noqa: E402
from tests.server.conftest import engine_config, tiny_model  # noqa: E402, F401


def test_prompt_tokens_match_the_engine(tiny_model: Path) -> None:  # noqa: F811
    engine = LLMEngine(engine_config(tiny_model))
    tok = engine.tokenizer
    text = "The valve opened twice, then the pressure dropped."
    want = engine.prepare(text, SamplingParams(max_tokens=1)).prompt_token_ids
    body = json.dumps({"model": "m", "prompt": text, "cache_salt": "t1"}).encode()
    assert prompt_tokens(tok, "/v1/completions", body) == (want, "t1")
    batch = json.dumps({"prompt": [text, "other"]}).encode()
    assert prompt_tokens(tok, "/v1/completions", batch) == (want, None)  # a batch routes by its first prompt
    assert prompt_tokens(tok, "/v1/completions", json.dumps({"prompt": [5, 6, 7]}).encode()) == ([5, 6, 7], None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = build_chat_input(tok, [ChatMessage.model_validate(m) for m in messages]).token_ids
    assert prompt_tokens(tok, "/v1/chat/completions", json.dumps({"messages": messages}).encode()) == (chat, None)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"prompt": ""}', b'{"prompt": [true]}',
                                  b'{"messages": "x"}', b'{"prompt": {"a": 1}}'])
def test_unreadable_bodies_route_by_load(tiny_model: Path, body: bytes) -> None:  # noqa: F811
    """Nothing to hash: the router falls back to load, and the replica answers with the proper 4xx."""
    from recap.model.loader import load_tokenizer

    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert prompt_tokens(load_tokenizer(tiny_model), path, body) == ([], None)


# Tools and reasoning effort rendered first, as Qwen's and Granite's templates put them in the system turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if reasoning_effort %}<|im_start|>system\neffort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
RESPONSES_TOOL = {"type": "function", "name": "get_time", "description": "The time in a zone.",
                  "parameters": TOOL["function"]["parameters"]}  # fmt: skip
ROUTED_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What time is it in Lima?"}], "tools": [TOOL]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Think hard: 17 x 23?"}],
                              "reasoning_effort": "high", "cache_salt": "s1"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Start a poem."},
                                           {"role": "assistant", "content": "Roses are"}],
                              "add_generation_prompt": False, "continue_final_message": True}),
    ("/v1/responses", {"input": "What time is it in Oslo?", "instructions": "Answer in one line.",
                       "tools": [RESPONSES_TOOL]}),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": "Count to three."},
                                 {"type": "message", "role": "assistant", "status": "in_progress",
                                  "content": [{"type": "output_text", "text": "One, two"}]}],
                       "reasoning": {"effort": "low"}}),
]


def test_chat_and_responses_prompts_match_the_replica(tiny_model: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
                                                      ) -> None:
    """Routing reads a chat request with its tools, reasoning effort and generation flags, and a Responses request
    as the chat request it is, through the served template (`--chat-template`, loaded by the ingress too): the
    tokens it hashes are the ones the replica prepares. (Hashed without tools, effort or the served template, no
    replica's published blocks would ever match.)"""
    import dataclasses

    import httpx

    from recap.engine.async_engine import AsyncEngine
    from recap.model.loader import load_tokenizer
    from recap.server import chat
    from recap.server.app import build_app
    from recap.server.options import ServerOptions
    from tests.server.conftest import MODEL_NAME, ServerThread

    prepared: list[list[int]] = []
    real = chat.prepare_all

    def recording(state: Any, prompts: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        prepared.append(list(prompts[0]))
        return real(state, prompts, *args, **kwargs)

    monkeypatch.setattr(chat, "prepare_all", recording)
    config = dataclasses.replace(engine_config(tiny_model), chat_template=TOOL_TEMPLATE)
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(config)), options=ServerOptions(tool_call_parser="hermes")))
    srv.start()
    try:
        ingress_tokenizer = load_tokenizer(str(tiny_model), TOOL_TEMPLATE)
        for path, body in ROUTED_BODIES:
            r = httpx.post(srv.url + path, json={"model": MODEL_NAME, "max_tokens" if "messages" in body
                                                 else "max_output_tokens": 2, **body}, timeout=60)  # fmt: skip
            assert r.status_code == 200, (path, r.text)
            tokens, salt = prompt_tokens(ingress_tokenizer, path, json.dumps(body).encode())
            assert tokens == prepared[-1], (path, body)
            assert salt == body.get("cache_salt")
        assert prompt_tokens(ingress_tokenizer, "/v1/responses", json.dumps(
            {"input": "Go on.", "previous_response_id": "resp_x_1"}).encode()) == ([], None)  # pinned, not hashed
    finally:
        srv.stop()
