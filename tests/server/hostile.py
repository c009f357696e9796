"""A hostile-input corpus (issue 20): each case is raw request bytes and the status it must get. Shared by the
server's test (tests/server/test_hostile.py) and the proxy's (tests/disagg/test_hostile_proxy.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

MODEL = "tiny-bamba"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    status: int
    words: str  # in the error message
    method: str = "POST"


def _raw(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def _nested(depth: int, inner: str = "1", kind: str = "list") -> str:
    return ("[" * depth + inner + "]" * depth) if kind == "list" else ('{"a":' * depth + inner + "}" * depth)


def _ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "integer"}}}


def corpus() -> list[Case]:
    c, chat = "/v1/completions", "/v1/chat/completions"
    head = f'{{"model":"{MODEL}","max_tokens":2,'
    return [
        Case("surrogate-prompt", c, (head + r'"prompt":"ab\ud800cd"}').encode(), 400, "lone surrogate"),
        Case("surrogate-low", c, (head + r'"prompt":["ok", "x\udfffy"]}').encode(), 400, "lone surrogate"),
        Case("surrogate-chat", chat, (head + r'"messages":[{"role":"user","content":"hi \ud83d"}]}').encode(), 400,
             "lone surrogate"),
        Case("surrogate-key", c, (head + r'"prompt":"hi","\ud800":1}').encode(), 400, "lone surrogate"),
        Case("surrogate-user", c, (head + r'"prompt":"hi","user":"\udc00"}').encode(), 400, "lone surrogate"),
        Case("temperature-nan", c, (head + '"prompt":"hi","temperature":NaN}').encode(), 400, "NaN"),
        Case("top-p-infinity", c, (head + '"prompt":"hi","top_p":Infinity}').encode(), 400, "Infinity"),
        Case("temperature-minus-infinity", chat,
             (head + '"messages":[{"role":"user","content":"hi"}],"temperature":-Infinity}').encode(), 400,
             "Infinity"),
        Case("overflow-float", c, (head + '"prompt":"hi","temperature":1e400}').encode(), 400, "overflows"),
        Case("temperature-nan-string", c, _raw(prompt="hi", temperature="NaN", max_tokens=2), 400, "temperature"),
        Case("deep-body-20k", c, (head + '"prompt":' + _nested(20_000) + "}").encode(), 400, "nested deeper"),
        Case("deep-prompt-100k", c, (head + '"prompt":' + _nested(100_000, '"x"') + "}").encode(), 400,
             "nested deeper"),
        Case("deep-logit-bias-50k", c, (head + '"prompt":"hi","logit_bias":' + _nested(50_000, "1", "dict") + "}")
             .encode(), 400, "nested deeper"),
        Case("deep-messages-100", chat, (head + '"messages":' + _nested(100, "{}") + "}").encode(), 400,
             "nested deeper"),
        Case("invalid-utf8", c, b'{"model":"tiny-bamba","prompt":"\xff\xfe"}', 400, "Invalid JSON"),
        Case("truncated", c, b'{"model":"tiny-bamba","prompt":"hi', 400, "Invalid JSON"),
        Case("not-an-object", c, b'["prompt", "hi"]', 400, "JSON object"),
        Case("empty", c, b"", 400, "Invalid JSON"),
        Case("null-body", chat, b"null", 400, "JSON object"),
        Case("huge-max-tokens", c, _raw(prompt="hi", max_tokens=10**30), 400, "maximum context length"),
        Case("negative-n", c, _raw(prompt="hi", n=-1), 400, "n"),
        Case("prompt-wrong-type", c, _raw(prompt={"a": 1}), 400, "prompt"),
        Case("token-id-out-of-range", c, _raw(prompt=[1, 2, 10**12], max_tokens=1), 400, "token id"),
        Case("messages-empty", chat, _raw(messages=[]), 400, "messages"),
        Case("role-unknown", chat, _raw(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
        Case("unknown-field", c, _raw(prompt="hi", frobnicate=1), 400, "frobnicate"),
        # issue 36 (N1, N3): inputs that killed the process in llguidance, or left it unconstrained
        Case("grammar-ref-chain-1000", c, _raw(prompt="hi", max_tokens=2, guided_json=_ref_chain(1000)), 400,
             "$ref resolutions"),
        Case("grammar-lark-3000-rules", c, _raw(prompt="hi", max_tokens=2, guided_grammar="start: r0\n" + "\n".join(
            f"r{i}: r{i + 1}" for i in range(3000)) + '\nr3000: "x"'), 400, "rules and terminals"),
        Case("grammar-regex-a-million", chat, _raw(messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                                   guided_regex="a{1000000}"), 400, "repetition bound"),
        Case("unknown-route", "/v1/nope", b"{}", 404, "Not Found"),
        Case("wrong-method", "/v1/completions", b"", 405, "Method Not Allowed", method="GET"),
    ]


def well_formed(path: str = "/v1/completions") -> dict:
    if path.endswith("chat/completions"):
        return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
