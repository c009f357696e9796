"""Tools in chat: the request's tool definitions and tool choice, the grammar that forces a call
(`required`, or a named function), and parsing the calls a model writes in its family's format.

Parsers, by the format the chat template teaches (vLLM's `--tool-call-parser` names):
- `hermes` (Hermes, Qwen and most ChatML templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- `granite` (IBM Granite): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`
- `nemotron` (NVIDIA Nemotron): `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`
- `qwen3_xml` (Qwen3.5, Qwen3-Coder, Nemotron 3): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`, each value JSON when it parses as JSON, else a string
A forced call (tool_choice `required` or named) is generated under a JSON grammar instead, so it needs
no parser: named -> the function's arguments; required -> `[{"name": ..., "parameters": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from recap.structured_output import StructuredOutput

PARSERS = ("hermes", "granite", "nemotron", "qwen3_xml")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec

    def template_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Strict):
    """A call in an assistant message the client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # clients that echo a streamed call back send its position; it carries nothing

    def template_dict(self) -> dict[str, Any]:
        """Templates index the arguments as a mapping (vLLM hands them over parsed the same way)."""
        try:
            args: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in a response (index: its position, for streamed deltas)."""

    index: int | None = None
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def _params(spec: ToolSpec) -> dict[str, Any]:
    return spec.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(
    tools: list[ToolSpec], choice: str | NamedToolChoice, parallel: bool = True
) -> StructuredOutput | None:
    """The grammar of a forced call; None when the model chooses (auto, none). `parallel` false: one call."""
    if isinstance(choice, NamedToolChoice):
        spec = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutput.json(_params(spec))
    if choice != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _params(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput.json(array)


def _call(name: str, arguments: Any, index: int) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(index=index, id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name,
                                                                                               arguments=args))


def forced_calls(text: str, tools: list[ToolSpec], choice: str | NamedToolChoice) -> list[ToolCall]:
    """The calls a forced generation wrote (the grammar guarantees the shape when it finished)."""
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text, 0)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens: no call, the text stays as content
    return [_call(it["name"], it.get("parameters", {}), i) for i, it in enumerate(items)]


def _calls_from_objects(objs: Any, known: set[str]) -> list[ToolCall] | None:
    if isinstance(objs, dict):
        objs = [objs]
    if not isinstance(objs, list):
        return None
    out = []
    for i, o in enumerate(objs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        if known and o["name"] not in known:
            return None
        out.append(_call(o["name"], o.get("arguments", o.get("parameters", {})), i))
    return out


_FORMATS = {
    "hermes": re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S),
    "granite": re.compile(r"<\|tool_call\|>\s*(.*)$", re.S),
    "nemotron": re.compile(r"<TOOLCALL>\s*(.*?)\s*(?:</TOOLCALL>|$)", re.S),
}


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_xml(text: str, known: set[str]) -> tuple[str | None, list[ToolCall]]:
    matches = list(_XML_CALL.finditer(text))
    if not matches or any(known and m.group(1) not in known for m in matches):
        return text, []
    calls = [_call(m.group(1), {k: _xml_value(v) for k, v in _XML_PARAM.findall(m.group(2))}, i)
             for i, m in enumerate(matches)]
    content = text[: matches[0].start()].strip()
    return content or None, calls


def parse_tool_calls(text: str, parser: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content left, calls) from free text in `parser`'s format; text that is no well-formed call of a
    known tool stays content, as vLLM's parsers leave it."""
    if parser == "qwen3_xml":
        return _parse_xml(text, {t.function.name for t in tools})
    pattern = _FORMATS[parser]
    matches = list(pattern.finditer(text))
    if not matches:
        return text, []
    known = {t.function.name for t in tools}
    calls: list[ToolCall] = []
    for m in matches:
        try:
            parsed = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        found = _calls_from_objects(parsed, known)
        if found is None:
            return text, []
        calls.extend(found)
    for i, c in enumerate(calls):
        c.index = i
    content = text[: matches[0].start()].strip()
    return content or None, calls


def detect_parser(chat_template: str | None) -> str | None:
    """The parser whose call markers the chat template writes (None: the template teaches no format)."""
    if not chat_template:
        return None
    if "<|tool_call|>" in chat_template:
        return "granite"
    if "<TOOLCALL>" in chat_template:
        return "nemotron"
    if "<function=" in chat_template:
        return "qwen3_xml"
    if "<tool_call>" in chat_template:
        return "hermes"
    return None
