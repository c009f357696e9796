"""The streamed tool-call parser (recap.server.tool_stream) against the whole-text reference
(recap.server.tools.parse_tool_calls / forced_calls) on random texts split at random points: the same
content and calls, each call released by the delta that completes it, no marker text sent as content."""

from __future__ import annotations

import json
import random

import pytest

from recap.server.tool_stream import ToolCallStream
from recap.server.tools import PARSERS, NamedToolChoice, ToolSpec, forced_calls, parse_tool_calls

TOOLS = [ToolSpec.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time", "search")]
WORDS = ["Sure.", "Let", "me", "check", "a < b", "x > y", "<tool", "<TOOL", "<|tool", "{", "}", "[", "]", "\n", " "]
STRINGS = ["Oslo", "a}b", "c]d", "<tool_call>", "</tool_call>", "\"quoted\"", "x\\y", "{[", ">", "", "naïve"]


def _args(rng: random.Random) -> dict:
    args: dict = {}
    for i in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.5:
            args[f"k{i}"] = rng.choice(STRINGS)
        elif kind < 0.7:
            args[f"k{i}"] = rng.randint(-5, 500)
        else:
            args[f"k{i}"] = {"nested": [rng.choice(STRINGS), {"deep": rng.random() < 0.5}]}
    return args


def _name(rng: random.Random) -> str:
    return "unknown_fn" if rng.random() < 0.1 else rng.choice(TOOLS).function.name


def _auto_text(rng: random.Random, parser: str) -> tuple[str, list[int]]:
    """A text in `parser`'s format and where each call's text ends (as a well-formed call would end)."""
    text = "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(0, 6)))
    ends: list[int] = []
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(0, 3))]
    sep = rng.choice(["", "\n", " "])
    if parser in ("hermes", "qwen3_xml"):
        for name, args in calls:
            if parser == "hermes":
                text += f'{sep}<tool_call>{sep}{json.dumps({"name": name, "arguments": args})}{sep}</tool_call>'
            else:
                params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                                 for k, v in args.items())
                text += f"{sep}<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
            ends.append(len(text))
    elif calls:
        text += sep + ("<|tool_call|>" if parser == "granite" else "<TOOLCALL>") + "["
        for i, (name, args) in enumerate(calls):
            text += ("," + sep if i else "") + json.dumps({"name": name, "arguments": args})
            ends.append(len(text))
        text += "]" + ("</TOOLCALL>" if parser == "nemotron" else "")
    if rng.random() < 0.2:
        text += rng.choice(["\n", " trailing words", "<tool_call>{broken"])
    if rng.random() < 0.2 and text:  # cut short, as max_tokens does
        text = text[: rng.randint(0, len(text))]
        ends = [e for e in ends if e <= len(text)]
    return text, ends


def _feed(stream: ToolCallStream, text: str, rng: random.Random) -> tuple[str, list, list[int]]:
    """Feeds `text` in random pieces; (content, calls, how much text was in when each call came out)."""
    content, calls, seen, i = "", [], [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 8))
        c, new = stream.feed(text[i:j])
        content += c
        calls += new
        seen += [j] * len(new)
        i = j
    c, new = stream.finish()
    return content + c, calls + new, seen + [len(text)] * len(new)


def _summary(calls: list) -> list[tuple[int | None, str, object]]:
    return [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("parser", PARSERS)
def test_stream_matches_the_whole_text_parser(parser: str) -> None:
    rng = random.Random(parser)
    released_early = 0
    for _ in range(400):
        text, ends = _auto_text(rng, parser)
        want_content, want_calls = parse_tool_calls(text, parser, TOOLS)
        content, calls, seen = _feed(ToolCallStream(TOOLS, "auto", parser), text, rng)
        assert content == (want_content or ""), text
        assert _summary(calls) == _summary(want_calls), text
        assert len({c.id for c in calls}) == len(calls)
        for end, at in zip(ends, seen):  # each call goes out by the piece that completes it
            assert at <= end + 8, (text, ends, seen)
            released_early += at < len(text)
    assert released_early > 50  # calls do stream before the text ends


def test_forced_calls_stream_like_the_whole_text() -> None:
    rng = random.Random(7)
    for _ in range(300):
        calls = [{"name": rng.choice(TOOLS).function.name, "parameters": _args(rng)} for _ in range(rng.randint(1, 3))]
        text = json.dumps(calls, indent=rng.choice([None, 1]))
        if rng.random() < 0.3:
            text = text[: rng.randint(0, len(text))]
        want = forced_calls(text, TOOLS, "required")
        content, got, _ = _feed(ToolCallStream(TOOLS, "required", None), text, rng)
        assert _summary(got) == _summary(want)
        assert content == ("" if want else text)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    content, got, seen = _feed(ToolCallStream(TOOLS, named, None), '{"tz": "UTC"}', rng)
    assert content == "" and _summary(got) == [(0, "get_time", {"tz": "UTC"})] and seen == [13]
    for _ in range(100):  # cut by max_tokens: arguments that are not JSON are no call, the text is content
        whole = json.dumps(_args(rng))
        text = whole[: rng.randint(0, len(whole))] if rng.random() < 0.5 else whole
        want = forced_calls(text, TOOLS, named)
        content, got, _ = _feed(ToolCallStream(TOOLS, named, None), text, rng)
        assert _summary(got) == _summary(want) and len(want) == (text == whole)
        assert content == ("" if want else text)


@pytest.mark.parametrize(("parser", "text", "content", "names"), [
    ("hermes", "  Hi <tool_call>", "  Hi <tool_call>", []),  # an empty call is no call: all content
    ("hermes", '  Hi\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "  Hi", ["get_time"]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "nope"}</tool_call>'
     '<tool_call>{"name": "search", "arguments": {}}</tool_call>', None, ["get_time"]),  # up to the first bad one
    ("nemotron", '<TOOLCALL>[{"name": "get_time", "arguments": {}}, {"name": "search", "argu', None, ["get_time"]),
    ("granite", '<|tool_call|>[]', "<|tool_call|>[]", []),
    ("nemotron", 'No.<TOOLCALL>[]</TOOLCALL>', "No.<TOOLCALL>[]</TOOLCALL>", []),
    ("qwen3_xml", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n", "<tool_call>\n<function=get_time>\n"
     "<parameter=tz>\nUTC\n", []),
])
def test_edge_cases_agree(parser: str, text: str, content: str | None, names: list[str]) -> None:
    want_content, want_calls = parse_tool_calls(text, parser, TOOLS)
    assert want_content == content and [c.function.name for c in want_calls] == names
    for seed in range(5):
        got_content, got_calls, _ = _feed(ToolCallStream(TOOLS, "auto", parser), text, random.Random(seed))
        assert got_content == (content or "") and [c.function.name for c in got_calls] == names


def test_auto_needs_a_parser() -> None:
    with pytest.raises(ValueError, match="parser"):
        ToolCallStream(TOOLS, "auto", None)
