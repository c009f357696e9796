"""The ingress tokenizes a request exactly as the replica that will serve it does (the router hashes that)."""

from __future__ import annotations

import json
from pathlib import Path

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
