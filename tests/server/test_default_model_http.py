"""`recap serve` without a model (what `make serve` runs) answers a chat request in English words."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from recap.model.trained_default import default_model_path
from tests.server.serve_process import recap_serve


def test_default_model_answers_a_chat_request_with_words(tmp_path: Path) -> None:
    known = frozenset((default_model_path() / "corpus_words.txt").read_text().split())
    with recap_serve([], tmp_path) as (url, _):
        body = {"messages": [{"role": "user", "content": "Tell me about the Congress."}],
                "max_tokens": 40, "temperature": 0.0}  # fmt: skip
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    text = reply["choices"][0]["message"]["content"]
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 5, reply
    assert sum(w in known for w in words) / len(words) >= 0.7, reply
