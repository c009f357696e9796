"""The reasoning parsers (recap.server.reasoning) on text: the whole-text split against the streamed one at every
split point (the pieces joined are the whole split), where an answer starts from the generation prompt, the
tool-call parser reading only what follows the think block, reasoning token counts, the grammar's start after
the think block (recap.runner.grammar), and an unknown parser name refused at startup."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.runner.grammar import GrammarBackend
from recap.server.answer_stream import AnswerStream
from recap.server.options import ServerOptions, add_http_args
from recap.server.reasoning import (
    PARSERS,
    ReasoningStream,
    answer_reasoning_tokens,
    opening,
    reasoning_format,
    split_reasoning,
)
from recap.server.tool_stream import ToolCallStream
from recap.server.tools import ToolSpec, parse_tool_calls

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
OPENINGS = ("open", "strict", "content")


@pytest.mark.parametrize(("fmt", "where", "text", "want"), [
    (QWEN3, "strict", "<think>\nplan\n</think>\n\nAnswer.", ("\nplan\n", "\n\nAnswer.")),  # whitespace kept
    (QWEN3, "strict", "  \n<think>a</think>b", ("a", "b")),  # blank text before the tag is dropped
    (QWEN3, "strict", "No block here.</think>tail", (None, "No block here.</think>tail")),  # never opened
    (QWEN3, "strict", "<think>cut short while thin", ("cut short while thin", None)),  # max_tokens hit
    (QWEN3, "strict", "<think></think>Only content.", (None, "Only content.")),  # empty block
    (QWEN3, "strict", "text <think>late</think>", (None, "text <think>late</think>")),  # not first: content
    (QWEN3, "open", "plan</think>\n\nAnswer.", ("plan", "\n\nAnswer.")),  # the template opened the block
    (QWEN3, "open", "<think>plan</think>A", ("plan", "A")),  # re-opened by the output: the tag is dropped
    (QWEN3, "open", "all thought", ("all thought", None)),
    (QWEN3, "content", "<think>x</think>y", (None, "<think>x</think>y")),  # thinking off: all content
    (R1, "open", "reasoning without a start tag</think>Answer", ("reasoning without a start tag", "Answer")),
    (R1, "open", "</think>", (None, None)),
    (R1, "open", "", (None, None)),
    (R1, "open", "a</think>b</think>c", ("a", "b</think>c")),  # the first end tag splits
])
def test_whole_text_split(fmt, where, text, want) -> None:
    assert split_reasoning(text, fmt, where) == want


def _streamed(fmt, where, pieces: list[str]) -> tuple[str | None, str | None]:
    read = ReasoningStream(fmt, where)
    thought, said = [], []
    for piece in pieces:
        r, c = read.feed(piece)
        thought.append(r)
        said.append(c)
    r, c = read.finish()
    return "".join([*thought, r]) or None, "".join([*said, c]) or None


TEXTS = ["<think>\nplan\n</think>\n\nAnswer.", "  <think>a</think>b", "plan</think>\n\nA", "<thin", "</thi", "x<",
         "<think>no end", "\n\n<th>not a tag", "a</think>b</think>c", "<think></think>", " \n ", "<<think>>"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_two_piece_split_streams_the_whole_split(text: str) -> None:
    for fmt in (QWEN3, R1):
        for where in OPENINGS:
            want = split_reasoning(text, fmt, where)
            for cut in range(len(text) + 1):
                assert _streamed(fmt, where, [text[:cut], text[cut:]]) == want, (fmt.name, where, cut)
            assert _streamed(fmt, where, list(text)) == want  # one character at a time


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<think", "</thi", "<", ">", "/", "think", " ", "\n", "plan",
                             "Answer.", "<tool_call>", "é"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(FRAGMENTS, max_size=12), cuts=st.lists(st.integers(0, 200), max_size=8),
       name=st.sampled_from(sorted(PARSERS)), where=st.sampled_from(OPENINGS))
def test_random_texts_split_at_random_points(parts: list[str], cuts: list[int], name: str, where: str) -> None:
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    fmt = reasoning_format(name)
    assert _streamed(fmt, where, pieces) == split_reasoning(text, fmt, where)


def test_where_the_answer_starts_comes_from_the_generation_prompt() -> None:
    assert opening(QWEN3, "<|im_start|>assistant\n<think>\n") == "open"  # Qwen3.5, Thinking models
    assert opening(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"  # enable_thinking false
    assert opening(QWEN3, "<|im_start|>assistant\n") == "strict"  # Qwen3 (2504): the model opens it
    assert opening(R1, "<|im_start|>assistant\n") == "open"  # DeepSeek-R1: the start tag may be anywhere before
    assert opening(R1, "<|im_start|>assistant\n", enable_thinking=False) == "content"  # vLLM's nemotron_v3
    assert opening(QWEN3, "<think>\n", enable_thinking=False) == "open"  # the template's rendering decides


TOOLS = [ToolSpec.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {}}})]
CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def test_tool_calls_come_from_the_content_only() -> None:
    """A call written inside the think block is reasoning; the one after it is the call, streamed as whole."""
    text = f"I could write {CALL} here.</think>\n\nChecking.\n{CALL}"
    reasoning, content = split_reasoning(text, R1, "open")
    assert reasoning == f"I could write {CALL} here."
    content_left, calls = parse_tool_calls(content, "hermes", TOOLS)
    assert content_left == "\n\nChecking." and [c.function.name for c in calls] == ["get_time"]
    for cut in range(len(text) + 1):
        answer = AnswerStream(ReasoningStream(R1, "open"), ToolCallStream(TOOLS, "auto", "hermes"))
        first, last = answer.step(text[:cut], last=False), answer.step(text[cut:], last=True)
        assert first.reasoning + last.reasoning == reasoning
        assert first.content + last.content == content_left
        assert [c.function.name for c in first.calls + last.calls] == ["get_time"]


def test_reasoning_tokens_are_those_before_the_end_tag() -> None:
    tokens = ["<think>", "pl", "an", "</think>", "\n\n", "A"]
    assert answer_reasoning_tokens("".join(tokens), tokens, QWEN3, "strict") == 3
    assert answer_reasoning_tokens("plan", ["pl", "an"], QWEN3, "open") == 2  # never ended: all of them
    assert answer_reasoning_tokens("Answer", ["Ans", "wer"], QWEN3, "strict") == 0
    assert answer_reasoning_tokens("x</think>y", ["x", "</think>", "y"], QWEN3, "content") == 0


def test_the_grammar_starts_after_the_end_tag_ids() -> None:
    grammar = GrammarBackend(tokenizer=None, eos_token_ids=frozenset())
    assert grammar.start("a", (), [5, 6]) == 0  # no think block: from the first token
    assert grammar.start("r", (7, 8), [1, 2, 7]) is None  # half the tag so far
    assert grammar.start("r", (7, 8), [1, 2, 7, 8, 9]) == 4  # the tag straddled two steps
    assert grammar.start("r", (7, 8), [1, 2, 7, 8, 9, 7, 8]) == 4  # found once, kept
    grammar.drop("r")
    assert grammar.start("r", (7, 8), [7, 1, 8]) is None


def test_an_unknown_parser_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'; recap knows qwen3, deepseek_r1"):
        reasoning_format("deepseek")
    parser = argparse.ArgumentParser()
    add_http_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    args = parser.parse_args(["--reasoning-parser", "nemotron_v3", "--structured-outputs-config.enable_in_reasoning",
                              "true"])
    assert (args.reasoning_parser, args.grammar_in_reasoning) == ("nemotron_v3", True)
    assert ServerOptions().reasoning_parser is None
