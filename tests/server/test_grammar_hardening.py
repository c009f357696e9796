"""Output constraints cannot kill, freeze or silently unconstrain the server (issue 36: N1, N3, N4, N5, N6).

N1 runs against a `recap serve` subprocess whose survival is asserted: grammars that overflowed llguidance's
stack are refused by recap.grammar_bounds, and ones just inside the bounds compile natively without harm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from recap.grammar_bounds import GrammarLimits, check_bounds
from tests.server.conftest import MODEL_NAME, ServerThread, wait_idle
from tests.server.serve_process import recap_serve

MSGS = [{"role": "user", "content": "Fill in the form."}]


def ref_chain(n: int) -> dict[str, Any]:
    """An object schema nesting `n` levels through `$ref`s (75 KB at n = 1,000)."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                                      "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


def alternatives(rules: str, n: int) -> str:
    """A Lark grammar whose start rule picks one of `rules`, each an alternation of `n` literals."""
    return f"start: {' | '.join(rules)}\n" + "\n".join(f"{r}: " + " | ".join(f'"{r}{i}"' for i in range(n))
                                                        for r in rules)


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# ---- the bounds themselves ----------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "spec", "words"), [
    ("json", json.dumps(ref_chain(1000)), "$ref resolutions"),
    ("json", json.dumps(nested_arrays(300)), "nested deeper than 256 levels"),
    ("json", json.dumps({"enum": list(range(1001))}), "`enum` has 1001 entries"),
    ("json", json.dumps({"type": "string", "pattern": "[a-z]{20000}"}), "repetition bound 20000"),
    ("regex", "a{1000000}", "repetition bound 1000000"),
    ("regex", "(x(ab){200}){60}", "multiply to 12000"),
    ("grammar", lark_chain(3000), "rules and terminals"),
    ("grammar", lark_chain(300), "nest deeper than 256"),
    ("grammar", "start: r0\n" + "\n".join(f"r{i}: ((((r{i + 1}))))" for i in range(60)) + '\nr60: "x"',
     "nest deeper than 256"),
    ("grammar", alternatives("a", 2000), "more than 1000 alternatives"),
    ("grammar", 'start: "a" ~ 3..50000', "repetition bound 50000"),
    ("grammar", 'start: %json {"type": "string", "maxLength": 3, "pattern": "b{99999}"}', "99999"),
    ("choice", json.dumps(["x"] * 100_001), "100001 choices"),
])
def test_bounds_refuse_what_breaks_the_native_library(kind: str, spec: str, words: str) -> None:
    with pytest.raises(ValueError) as e:
        check_bounds(kind, spec)
    assert words in str(e.value), str(e.value)


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    work: Address | None = None
    friends: list[Person] = []  # recursive: a $ref back into its own path


def test_bounds_accept_real_schemas_grammars_and_regexes() -> None:
    dag = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(40)}
    dag["d40"] = {"type": "integer"}
    start = time.perf_counter()
    check_bounds("json", json.dumps({"$ref": "#/$defs/d0", "$defs": dag}))  # 2^40 paths, walked once each
    assert time.perf_counter() - start < 1.0
    check_bounds("json", json.dumps(Person.model_json_schema()))
    check_bounds("json", json.dumps(ref_chain(60)))
    check_bounds("regex", r"[a-z{}]{1,5000}\{99999\}(ab{2}){3000}")
    check_bounds("grammar", lark_chain(200))
    check_bounds("grammar", 'start: expr\nexpr: expr "+" term | term\nterm: /[0-9]{1,20}/ | "(" expr ")"\n'
                            '// a comment with | bars | and {99999}\n%ignore " "')
    check_bounds("choice", json.dumps([f"option {i}" for i in range(100_000)]))
    with pytest.raises(ValueError, match="at most 10 are allowed"):
        check_bounds("json", json.dumps({"anyOf": [{"type": "integer"}] * 11}), GrammarLimits(max_width=10))


# ---- N1: a subprocess server survives ---------------------------------------------------------

def test_hostile_grammars_are_refused_and_the_server_process_survives(tiny_model: Path, tmp_path: Path) -> None:
    chain = ref_chain(1000)
    chat = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4}
    hostile = [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": chain}}},
         "response_format: json over a limit"),
        ("/v1/chat/completions", {**chat, "tools": [tool("f", chain)],
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools: json"),
        ("/v1/chat/completions", {**chat, "tools": [tool("f", chain)], "tool_choice": "required"}, "tools: json"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "guided_json": chain}, "guided_json"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "guided_grammar": lark_chain(3000)},
         "guided_grammar: grammar over a limit: more than 2000 rules"),
    ]
    # just inside the bounds: compiled by llguidance on the server's threads, which must hold them
    deep_ok = [{"guided_json": ref_chain(60)}, {"guided_grammar": lark_chain(250)},
               {"guided_json": {"$ref": "#/$defs/d0", "$defs": {
                   **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(63)}, "d63": {"type": "integer"}}}}]
    args = [str(tiny_model), "--served-model-name", MODEL_NAME, "--max-model-len", "512"]
    with recap_serve(args, tmp_path) as (url, _), httpx.Client(base_url=url, timeout=120) as c:
        for path, body, words in hostile:
            r = c.post(path, json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text[:400])
            assert c.get("/health").status_code == 200
        for extra in deep_ok:
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, **extra})
            assert r.status_code == 200, r.text[:400]
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "Hello!"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# ---- N3 / N5: kept or refused, logged once ----------------------------------------------------

def test_large_constraints_are_kept_or_refused(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "Pick:", "max_tokens": 16, "temperature": 1.0, "seed": 7}
    options = [f"option number {i}" for i in range(2000)]
    r = http.post("/v1/completions", json={**body, "guided_choice": options})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in options, r.text[:300]
    refused = [({"guided_regex": "a{1000000}"}, "guided_regex: regex over a limit: repetition bound 1000000"),
               ({"guided_grammar": alternatives("a", 2000)}, "more than 1000 alternatives"),
               ({"structured_outputs": {"choice": ["x"] * 100_001}}, "structured_outputs.choice: choice over a limit")]
    for extra, words in refused:
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text[:300]
    tools = [tool(f"t{i}", {"type": "object", "properties": {"x": {"type": "integer"}}}) for i in range(3000)]
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MSGS, "tools": tools,
                                                "tool_choice": "required", "max_tokens": 8})
    assert r.status_code == 400 and "tools: json over a limit: `anyOf` has 3000 entries" in r.text, r.text[:300]


@pytest.mark.parametrize("stream", [False, True])
def test_a_matcher_that_fails_mid_generation_ends_the_request_with_an_error(
    http: httpx.Client, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Three rules of 900 branches pass the bounds; after the first token llguidance's row holds 2,704 items
    (its cap: 2,000). The request ends with finish_reason "error" and the one constrained token, never with
    unconstrained text; one short log line says why."""
    grammar = alternatives("abc", 900)
    body = {"model": MODEL_NAME, "prompt": "Pick:", "max_tokens": 32, "temperature": 1.0, "seed": 3,
            "guided_grammar": grammar, "stream": stream}
    with caplog.at_level(logging.WARNING, logger="recap.runner"):
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        else:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text[:300]
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        report = wait_idle(http)
    assert finish == "error"
    assert any(w.startswith(text) for r in "abc" for w in (f"{r}{i}" for i in range(900))), text
    lines = [rec.getMessage() for rec in caplog.records if "structured output failed" in rec.getMessage()]
    assert len(lines) == 1 and "2000" in lines[0] and len(lines[0]) < 600 and '"b899"' not in lines[0], lines
    assert report["ok"], report


# ---- N4: compiled off the loop ----------------------------------------------------------------

def test_health_answers_while_a_large_choice_list_compiles(server: ServerThread) -> None:
    options = [f"candidate answer {i:06d}" for i in range(100_000)]  # 2.6 MB

    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def heavy() -> None:
                r = await c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Pick:", "max_tokens": 30,
                                                          "guided_choice": options})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] in options, r.text[:300]
                order.append("choice")

            async def light() -> None:
                await asyncio.sleep(0.5)  # the body is in; its grammar is being bounded and compiled
                for _ in range(3):
                    assert (await c.get("/health")).status_code == 200
                    order.append("health")

            await asyncio.gather(heavy(), light())
        return order

    assert asyncio.run(run()) == ["health", "health", "health", "choice"]


# ---- N6: pydantic's $defs under required ------------------------------------------------------

class Trip(BaseModel):
    origin: Address
    destination: Address


def test_tool_parameters_with_defs_work_under_required_as_under_a_named_tool(http: httpx.Client) -> None:
    tools = [tool("book", Trip.model_json_schema()), tool("find", Person.model_json_schema())]
    body = {"model": MODEL_NAME, "messages": MSGS, "tools": tools, "max_tokens": 400, "temperature": 1.0}
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        for seed in range(3):
            r = http.post("/v1/chat/completions", json={**body, "tool_choice": choice, "seed": seed})
            assert r.status_code == 200, r.text[:300]
            message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
            if finish == "tool_calls":
                for call in message["tool_calls"]:
                    model = Trip if call["function"]["name"] == "book" else Person
                    model.model_validate_json(call["function"]["arguments"])
