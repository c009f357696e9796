"""What a request's output must match (vLLM's StructuredOutputsParams): a JSON schema, any JSON object,
a regex, one of a list of strings, or a Lark grammar. Torch-free; the runner enforces it through
llguidance (recap/runner/grammar.py), which was chosen over xgrammar and outlines-core (docs/design.md
§8: no torch/triton dependency, ~1-8 ms to compile a schema, ~15 us per token mask on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from recap.grammar_bounds import check_bounds

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON is generated compact (no free whitespace): a model cannot then pad its output with spaces forever.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 300  # of llguidance's message in a 400 or a log line (it may quote the whole grammar)


def short_error(message: str) -> str:
    """llguidance's error, first line and at most MAX_ERROR_CHARS (no grammar dump, no parser state)."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # JSON schema text, regex, JSON list of choices, or a Lark grammar; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        return cls("choice", json.dumps(options))

    def grammar(self) -> str:
        """The llguidance grammar (raises ValueError on a malformed spec)."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            # One terminal (the lexer's automaton), not one rule branch per option: the parser caps the
            # items of a row (2,000), a terminal has no such cap, so a long list cannot fail mid-generation.
            options = " | ".join(json.dumps(o) for o in json.loads(self.spec))
            return LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}")
        return LLMatcher.grammar_from_lark(self.spec)

    def compiled(self) -> str:
        """The grammar, within recap.grammar_bounds and validated by llguidance (compiled once per request);
        raises ValueError naming what is wrong. Large inputs take a while: callers run it off the event loop.
        Kept on the instance by hand: functools.cached_property would hold one lock for every instance."""
        done = self.__dict__.get("_compiled")
        if done is None:
            done = self.__dict__["_compiled"] = self._compile()
        return done

    def _compile(self) -> str:
        from llguidance import LLMatcher

        try:
            check_bounds(self.kind, self.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs: invalid {self.kind}: {e}") from None
        except ValueError as e:
            raise ValueError(f"structured_outputs: {self.kind} over a limit: {e}") from None
        try:
            grammar = self.grammar()
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"structured_outputs: invalid {self.kind}: {short_error(str(e))}") from None
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"structured_outputs: invalid {self.kind}: {short_error(error)}")
        return grammar

    def check(self) -> None:
        """Raises ValueError when the spec is over a bound or does not compile."""
        self.compiled()
