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
A forced answer cut by max_tokens has one shape for both (README "Structured output and tools"): the calls
whose arguments are complete JSON, or, when there is none, the raw text as content; finish_reason "length".
`parse_tool_calls` and `forced_calls` read a whole text (the answer that is not streamed);
recap.server.tool_stream reads it as it streams and releases each call when it completes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
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


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#", "#/...") pointing below `root` instead of the document root."""
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rerooted(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def tool_constraint(
    tools: list[ToolSpec], choice: str | NamedToolChoice, parallel: bool = True
) -> StructuredOutput | None:
    """The grammar of a forced call, bounded and compiled (a ValueError naming `tools` otherwise; off the event
    loop for a large request); None when the model chooses (auto, none). `parallel` false: one call."""
    if isinstance(choice, NamedToolChoice):
        spec = next(t for t in tools if t.function.name == choice.function.name)
        return _checked(StructuredOutput.json(_params(spec)))
    if choice != "required":
        return None
    # Each tool's parameters sit under the root's $defs, their local $refs re-rooted there: a pydantic
    # schema's "#/$defs/Model" then resolves inside its own tool, as it does under a named choice.
    defs = {f"tool{i}": _rerooted(_params(t), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not parallel:
        array["maxItems"] = 1
    return _checked(StructuredOutput.json(array))


def _checked(forced: StructuredOutput) -> StructuredOutput:
    try:
        forced.check()
    except ValueError as e:
        raise ValueError(f"tools: {str(e).removeprefix('structured_outputs: ')}") from None
    return forced


def new_call(name: str, arguments: Any, index: int) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(index=index, id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name,
                                                                                               arguments=args))


def object_call(obj: Any, known: set[str], index: int) -> ToolCall | None:
    """The call a parsed `{"name": ..., "arguments"|"parameters": {...}}` object writes; None when it is
    no call of a known tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known:
        return None
    return new_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), index)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")
_SEPARATOR = re.compile(r"[\s,]*")


def json_values(body: str) -> tuple[list[Any], bool]:
    """The JSON values `body` starts with: the elements of an array, in order up to the first that does not
    decode (so an array cut short keeps its complete elements), or one lone value; and whether the array
    closed (or the lone value decoded). Text after the array or value is not read."""
    i = _SPACE.match(body).end()  # type: ignore[union-attr]
    if not body.startswith("[", i):
        try:
            return [_DECODER.raw_decode(body, i)[0]], True
        except json.JSONDecodeError:
            return [], False
    items: list[Any] = []
    i += 1
    while True:
        i = _SEPARATOR.match(body, i).end()  # type: ignore[union-attr]
        if i >= len(body):
            return items, False
        if body[i] == "]":
            return items, True
        try:
            value, i = _DECODER.raw_decode(body, i)
        except json.JSONDecodeError:
            return items, False
        items.append(value)


# Each format's call block: its start marker and the marker that ends it (granite: none, the block runs
# to the end of the text; qwen3_xml: one call per block, ended by </function>).
MARKERS: dict[str, tuple[str, str | None]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "granite": ("<|tool_call|>", None),
    "nemotron": ("<TOOLCALL>", "</TOOLCALL>"),
    "qwen3_xml": ("<tool_call>", "</function>"),
}
# The marker texts a tokenizer may hold as single (possibly special) tokens.
_MARKER_TOKENS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "granite": ("<|tool_call|>",),
    "nemotron": ("<TOOLCALL>", "</TOOLCALL>"),
    "qwen3_xml": ("<tool_call>", "</tool_call>"),
}
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def xml_object(block: str) -> dict[str, Any] | None:
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>` as a call object."""
    m = _XML_CALL.fullmatch(block)
    if m is None:
        return None
    return {"name": m.group(1), "arguments": {k: _xml_value(v) for k, v in _XML_PARAM.findall(m.group(2))}}


def _call_objects(text: str, parser: str, first: int) -> Iterator[Any]:
    """The call objects written from the first marker (at `first`) on, in order; a block that is not
    well-formed ends them with None."""
    start, end = MARKERS[parser]
    at = first
    while at >= 0:
        body_at = at + len(start)
        close = text.find(end, body_at) if end else -1
        if parser == "qwen3_xml":
            if close < 0:
                return
            yield xml_object(text[at: close + len(end)])  # type: ignore[arg-type]
        else:
            items, closed = json_values(text[body_at: close if close >= 0 else len(text)])
            yield from items
            if not closed:
                yield None
                return
        if close < 0:
            return
        at = text.find(start, close + len(end))  # type: ignore[arg-type]


def parse_tool_calls(text: str, parser: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from free text in `parser`'s format (the reference for recap.server.tool_stream).

    The calls are the well-formed calls of known tools from the first call marker on, in order, up to the
    first that is not one; the content is the text before that marker (trailing whitespace dropped; None
    when blank). Text with no such call is all content, as vLLM's parsers leave it."""
    first = text.find(MARKERS[parser][0])
    if first < 0:
        return text, []
    known = {t.function.name for t in tools}
    calls: list[ToolCall] = []
    for obj in _call_objects(text, parser, first):
        call = object_call(obj, known, len(calls))
        if call is None:
            break
        calls.append(call)
    if not calls:
        return text, []
    return text[:first].rstrip() or None, calls


def named_call(name: str, text: str) -> ToolCall | None:
    """A forced named call: `text` is its arguments, or None when they are not JSON (max_tokens cut them)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return None
    return new_call(name, text, 0)


def forced_calls(text: str, tools: list[ToolSpec], choice: str | NamedToolChoice) -> list[ToolCall]:
    """The calls a forced generation wrote, each with arguments that are whole JSON: named -> its arguments
    when they parse; required -> the array's complete calls (the grammar guarantees the shape; max_tokens may
    cut it short). None at all (cut before any call was complete): the caller returns the text as content."""
    if isinstance(choice, NamedToolChoice):
        call = named_call(choice.function.name, text)
        return [] if call is None else [call]
    known = {t.function.name for t in tools}
    calls: list[ToolCall] = []
    for obj in json_values(text)[0]:
        call = object_call(obj, known, len(calls))
        if call is None:
            break
        calls.append(call)
    return calls


def special_marker_ids(tokenizer: Any, parser: str | None, special: frozenset[int]) -> tuple[int, ...]:
    """The parser's call markers that the tokenizer holds as special tokens (`special`): decoding with
    skip_special_tokens would erase them and the parser would find no call, so they are kept."""
    ids: list[int] = []
    for marker in _MARKER_TOKENS.get(parser or "", ()):
        tok = tokenizer.encode(marker, add_special_tokens=False)
        if len(tok) == 1 and tok[0] in special and tok[0] not in ids:
            ids.append(tok[0])
    return tuple(ids)


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
