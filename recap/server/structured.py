"""Request fields that constrain the output, as OpenAI and vLLM name them, -> one StructuredOutput:
`response_format` (json_object / json_schema / text), vLLM's `structured_outputs` {json, regex, choice,
grammar, json_object} and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
At most one may be set (and none together with a forced tool call); a bad one is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from recap.structured_output import StructuredOutput


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return self


class StructuredOutputsField(Strict):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _one(found: list[tuple[str, StructuredOutput]]) -> StructuredOutput | None:
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one output constraint per request (also got {found[0][0]})")
    return found[0][1] if found else None


def _json(schema: dict[str, Any] | str, field: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object")
    return StructuredOutput.json(schema)


def structured_output(
    response_format: ResponseFormat | None, structured: StructuredOutputsField | None, guided: dict[str, Any]
) -> StructuredOutput | None:
    """The request's single output constraint (None: free text). Raises ValueError naming the field."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        else:
            assert response_format.json_schema is not None and response_format.json_schema.schema_ is not None
            found.append(("response_format", _json(response_format.json_schema.schema_, "response_format")))
    if structured is not None:
        inner: list[tuple[str, StructuredOutput]] = []
        if structured.json_ is not None:
            inner.append(("structured_outputs.json", _json(structured.json_, "structured_outputs.json")))
        if structured.regex is not None:
            inner.append(("structured_outputs.regex", StructuredOutput("regex", structured.regex)))
        if structured.choice is not None:
            inner.append(("structured_outputs.choice", StructuredOutput.choice(structured.choice)))
        if structured.grammar is not None:
            inner.append(("structured_outputs.grammar", StructuredOutput("grammar", structured.grammar)))
        if structured.json_object:
            inner.append(("structured_outputs.json_object", StructuredOutput("json_object")))
        if not inner:
            raise ValueError("structured_outputs: give one of json, regex, choice, grammar, json_object")
        found.extend(inner)
    for name, value in guided.items():
        if value is None:
            continue
        if name == "guided_json":
            found.append((name, _json(value, name)))
        elif name == "guided_choice":
            try:
                found.append((name, StructuredOutput.choice(value)))
            except ValueError:
                raise ValueError("guided_choice: must be a non-empty list of strings") from None
        else:
            found.append((name, StructuredOutput("regex" if name == "guided_regex" else "grammar", value)))
    so = _one(found)
    if so is not None:
        try:
            so.check()
        except ValueError as e:
            field = next(n for n, s in found if s is so)
            raise ValueError(f"{field}: {str(e).removeprefix('structured_outputs: ')}") from None
    return so
