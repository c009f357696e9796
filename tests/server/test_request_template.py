"""Request-level chat templates (issue 36, N2): refused unless the server trusts them; when trusted, rendered in
a sandboxed process off the event loop, and a template that loops, explodes or escapes is a 400 while the
server keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from recap.server.options import ServerOptions
from recap.server.template_sandbox import TemplateLimits
from tests.server.conftest import MODEL_NAME, TEST_LIMITS, ServerThread, engine_config, wait_idle

CHAT = "/v1/chat/completions"
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")
LIMITS = TemplateLimits(timeout_s=3.0, max_output_chars=100_000, memory_bytes=256 * 2**20)


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2,
            "temperature": 0, **kw}


@pytest.fixture(scope="module")
def trusted(tiny_model: Path) -> Iterator[ServerThread]:
    options = ServerOptions(trust_request_chat_template=True, chat_template_limits=LIMITS)
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(tiny_model))), limits=TEST_LIMITS,
                                 options=options))
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("body", [_chat(chat_template=PLAIN), _chat(chat_template_kwargs={"chat_template": PLAIN})],
                         ids=["field", "kwargs"])
def test_refused_unless_the_server_trusts_them(http: httpx.Client, body: dict[str, Any]) -> None:
    r = http.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["code"] == "chat_template_not_allowed", err
    assert "--trust-request-chat-template" in err["message"]


def test_a_trusted_template_renders_the_prompt(trusted: ServerThread) -> None:
    with httpx.Client(base_url=trusted.url, timeout=60) as http:
        expected = "[user] Hi there\n[assistant] "
        count = http.post("/tokenize", json={"prompt": expected}).json()["count"]
        for body in (_chat(chat_template=PLAIN), _chat(chat_template_kwargs={"chat_template": PLAIN, "x": 1})):
            r = http.post(CHAT, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == count
        default = http.post(CHAT, json=_chat())  # no template of its own: the model's
        assert default.status_code == 200 and default.json()["usage"]["prompt_tokens"] != count


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = [
    ("loops", LOOP, "longer than 3s"),
    ("doubles", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s }}", "memory"),
    ("multiplies", "{{ 'a' * 4000000000 }}", "memory"),
    ("power", "{{ 7 ** (7 ** 9) }}", ""),
    ("output", "{{ 'a' * 200000 }}", "more than the 100000 allowed"),
    ("escapes", "{{ messages.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("raises", "{{ raise_exception('no such luck') }}", "no such luck"),
    ("syntax", "{% for %}", "chat template rejected"),
]


@pytest.mark.parametrize(("name", "template", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_template_is_a_400_and_the_server_keeps_serving(
    trusted: ServerThread, name: str, template: str, words: str
) -> None:
    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=trusted.url, timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.05)

    watcher = threading.Thread(target=probe)
    watcher.start()
    try:
        with httpx.Client(base_url=trusted.url, timeout=60) as http:
            t0 = time.monotonic()
            r = http.post(CHAT, json=_chat(chat_template=template))
            took = time.monotonic() - t0
            assert r.status_code == 400, (name, r.text[:300])
            err = r.json()["error"]
            assert words in err["message"] and err["param"] in ("chat_template", "messages"), (name, err)
            assert took < LIMITS.timeout_s * 2 + 5, (name, took)
            ok = http.post(CHAT, json=_chat(chat_template=PLAIN))
            assert ok.status_code == 200, ok.text
            assert wait_idle(http)["ok"]
    finally:
        stop.set()
        watcher.join()
    assert health and max(health) < 1.0, (name, max(health))  # the loop kept answering throughout


def test_template_arguments_are_checked(trusted: ServerThread) -> None:
    with httpx.Client(base_url=trusted.url, timeout=60) as http:
        r = http.post(CHAT, json=_chat(chat_template=PLAIN, chat_template_kwargs={"chat_template": "{{ 1 }}"}))
        assert r.status_code == 400 and "disagree" in r.json()["error"]["message"], r.text
        r = http.post(CHAT, json=_chat(chat_template_kwargs={"chat_template": 5}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        r = http.post(CHAT, json=_chat(chat_template=PLAIN, chat_template_kwargs={"tokenize": True}))
        assert r.status_code == 400 and "tokenize is not a template variable" in r.json()["error"]["message"], r.text


def test_the_sandbox_renders_as_the_tokenizer_does(tiny_model: Path) -> None:
    """The model's own template, sent as a request's: the same text as apply_chat_template (the same Jinja
    settings and globals), with and without tools and the generation prompt."""
    from transformers import AutoTokenizer

    from recap.engine.chat import tokenizer_renderer
    from recap.server.template_sandbox import TemplateSandbox

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sandboxed = TemplateSandbox().renderer(tok.chat_template, tok)
    plain = tokenizer_renderer(tok)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve \"quotes\""},
                    {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    for messages, gen, variables in [(conversation, True, {}), (conversation[1:2], False, {}),
                                     (conversation, True, {"tools": [tool]})]:
        assert sandboxed(messages, gen, variables) == plain(messages, gen, variables)
