"""POST /v1/responses request models (OpenAI's Responses API, with vLLM's extensions) and how a request maps
onto a chat request (recap.server.protocol.ChatCompletionRequest), whose rendering, sampling, tools and output
constraints it then shares.

The mapping: `instructions` is a system message first (never carried over by `previous_response_id`, as
OpenAI); a string `input` is one user message; `message` items are chat messages (their text parts joined
with newlines, as chat joins parts); `function_call` items are the tool calls of an assistant message (merged
into the message before them when it is an assistant's, as vLLM); `function_call_output` items are tool
messages. A last assistant message whose status is `in_progress` or `incomplete` is continued rather than
answered (vLLM's `continue_final_message` for the Responses API). `max_output_tokens` is `max_tokens`;
`text.format` is `response_format`; function tools and `tool_choice` take chat's shape. vLLM's sampling
extensions (recap.server.protocol.GenerationFields) pass through unchanged; `reasoning.effort` is chat's
`reasoning_effort`; a previous answer's `reasoning` item is the reasoning of the assistant turn it starts.
`include: ["message.output_text.logprobs"]` is chat's `logprobs: true` and `top_logprobs` (0-20) chat's
`top_logprobs` (recap.server.responses_api_logprobs renders them); `include: ["reasoning.encrypted_content"]`
puts each reasoning item's text in its `encrypted_content` too, which a later input item may carry alone
(recap.server.reasoning_blob). OpenAI's platform fields that ask for
something recap has not (other `include` values, reasoning summaries, background runs, truncation "auto",
prompt templates, conversations) are a 400 naming the field unless they are at their no-op value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from recap.server import reasoning_blob
from recap.server.protocol import ChatCompletionRequest, ChatMessage, GenerationFields, _Strict
from recap.server.responses_api_logprobs import INCLUDE_LOGPROBS, MAX_TOP_LOGPROBS
from recap.server.tools import AssistantToolCall, CalledFunction

MAX_METADATA_PAIRS = 16  # OpenAI's metadata bounds
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


def _known_type(data: Any, kinds: tuple[str, ...], what: str, default: str | None = None) -> Any:
    """An unsupported `type` named first (before the fields that come with it are refused one by one)."""
    kind = data.get("type", default) if isinstance(data, dict) else None
    if isinstance(data, dict) and kind not in kinds:
        raise ValueError(f"type {kind!r} is not supported (recap takes {', '.join(kinds)} {what})")
    return data


class ContentPart(_Strict):
    """A text part of a message: `input_text`, or a previous answer's `output_text`."""

    type: Literal["input_text", "output_text", "reasoning_text"]
    text: str
    # output_text's own metadata (citations, the logprobs an answer reported): nothing of it reaches the prompt
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _known_type(data, ("input_text", "output_text", "reasoning_text"), "parts: text only")


# The fields each item type takes, besides type, id and status.
_ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ()}
_OPTIONAL_FIELDS = {"reasoning": ("content", "summary", "encrypted_content")}


class InputItem(_Strict):
    """One item of `input`: a message (`type` may be left out), a `function_call` of a previous answer, the
    `function_call_output` answering it, or a previous answer's `reasoning` (its reasoning_text content). One model
    for them all so that errors name plain paths."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = None
    status: ITEM_STATUS | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: list[ContentPart] | None = None  # a string is one input_text part
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None  # JSON text, as the answer wrote it
    output: str | None = None
    # A reasoning item's text: its reasoning_text content, else the text of its encrypted_content (recap's
    # reasoning_blob; another server's is opaque), else its summary's texts (recap writes no summary).
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    _reasoning: str = PrivateAttr(default="")

    @model_validator(mode="before")
    @classmethod
    def _supported_type(cls, data: Any) -> Any:
        return _known_type(data, tuple(_ITEM_FIELDS), "items", default="message")

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_part(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "input_text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of input_text / output_text parts")
        return v

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        own = _ITEM_FIELDS[self.type]
        stray = sorted(self.model_fields_set - {"type", "id", "status", *own, *_OPTIONAL_FIELDS.get(self.type, ())})
        if stray:
            raise ValueError(f"{stray[0]}: not a field of a {self.type} item (it takes {', '.join(own)})")
        missing = [f for f in own if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        if self.type == "reasoning":
            self._reasoning = self._reasoning_text()
        return self

    def _reasoning_text(self) -> str:
        if self.content is not None:
            return self._parts_text()
        if self.encrypted_content is not None:
            try:
                decoded = reasoning_blob.decode(self.encrypted_content)
            except ValueError as e:
                raise ValueError(f"encrypted_content: {e} (send the item back as recap returned it)") from None
            if decoded is not None:
                return decoded
        texts = [part.get("text") for part in self.summary or []]
        return "\n".join(t for t in texts if isinstance(t, str))

    def text(self) -> str:
        """A message's text parts joined; a reasoning item's reasoning (see `summary` above)."""
        return self._reasoning if self.type == "reasoning" else self._parts_text()

    def _parts_text(self) -> str:
        return "\n".join(p.text for p in self.content or [])


def chat_messages(items: Sequence[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: function calls join the assistant message before them; a reasoning item is
    the reasoning of the assistant turn it starts (vLLM's mapping; the chat template decides what renders)."""
    out: list[ChatMessage] = []
    for item in items:
        last = out[-1] if out else None
        if item.type == "reasoning":
            out.append(ChatMessage(role="assistant", content=None, reasoning=item.text()))
        elif item.type == "message":
            assert item.role is not None
            if item.role == "assistant" and last is not None and _thought_only(last):
                last.content = item.text()
            else:
                out.append(ChatMessage(role=item.role, content=item.text()))
        elif item.type == "function_call_output":
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            assert item.call_id is not None and item.name is not None and item.arguments is not None
            call = AssistantToolCall(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    return out


def _thought_only(message: ChatMessage) -> bool:
    """An assistant turn that so far holds only its reasoning (its message may follow)."""
    return message.role == "assistant" and message.reasoning is not None and message.content is None and \
        not message.tool_calls


class FunctionTool(_Strict):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        fields = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fields}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type json_schema needs name and schema")
        if self.type != "json_schema" and self.model_fields_set - {"type"}:
            raise ValueError(f"type {self.type} takes no other field")
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's response_format of the same constraint."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = self.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; other values ask the model for what it has not


class ReasoningConfig(_Strict):
    """`effort` is chat's reasoning_effort (a chat template variable, as vLLM passes it); recap writes no
    summaries, so `summary` (and its older name `generate_summary`) takes only "auto" (whatever the model gives:
    an empty summary), not "concise" or "detailed"."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool = False  # OpenAI's padding of delta events; recap adds none, so only false


class ResponsesRequest(GenerationFields):
    input: list[InputItem]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # OpenAI's default; the server's --responses-store-size bounds what is kept
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None  # only "message.output_text.logprobs"
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per output token
    # OpenAI's platform fields, accepted at the values that ask for nothing recap lacks
    background: bool = False
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None  # a routing hint: recap's cache matches prefixes whatever it says
    safety_identifier: str | None = None  # logged as `user` is

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of input items")
        return v

    @field_validator("include")
    @classmethod
    def _known_include(cls, v: list[str] | None) -> list[str] | None:
        known = (INCLUDE_LOGPROBS, reasoning_blob.INCLUDE_REASONING)
        for value in v or []:
            if value not in known:
                raise ValueError(f"{value!r} is not supported (recap includes {' and '.join(map(repr, known))})")
        return v

    @property
    def encrypted_reasoning(self) -> bool:
        """Whether reasoning items carry their text as `encrypted_content` (recap.server.reasoning_blob)."""
        return reasoning_blob.INCLUDE_REASONING in (self.include or [])

    @property
    def output_logprobs(self) -> bool:
        """Whether the answer's output_text carries its tokens' logprobs."""
        return INCLUDE_LOGPROBS in (self.include or [])

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")
        if self.truncation == "auto":
            raise ValueError('truncation: only "disabled" is supported (recap never drops input to make room; a '
                             "prompt over the model's context is a 400)")
        if self.top_logprobs and not self.output_logprobs:  # asked alternatives would go nowhere: not ignored
            raise ValueError(f"top_logprobs needs include [{INCLUDE_LOGPROBS!r}] (the logprobs it adds to)")
        unsupported = {"background": self.background, "max_tool_calls": self.max_tool_calls is not None,
                       "prompt": self.prompt is not None, "conversation": self.conversation is not None}
        for name, asked in unsupported.items():
            if asked:
                raise ValueError(f"{name} is not supported by recap (only its default)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ValueError("stream_options: include_obfuscation is not supported (only false)")
        self._check_metadata()
        self._check_tools()
        return self

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata takes at most {MAX_METADATA_PAIRS} pairs")
        for k, v in meta.items():
            if len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"at most {MAX_METADATA_VALUE_CHARS}")

    def _check_tools(self) -> None:
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, FunctionChoice)
        constrained = self.text is not None and self.text.format is not None and self.text.format.type != "text"
        if forced and constrained:
            raise ValueError("tool_choice: a forced tool call cannot be combined with a text.format constraint")

    def chat_request(self, history: Sequence[ChatMessage]) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
        """The chat request this request is, after `history` (a stored conversation), and the new messages it
        adds to that conversation (its input: instructions are not part of it). Raises ValidationError."""
        new = chat_messages(self.input)
        messages = [*history, *new]
        if self.instructions is not None:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        last = self.input[-1]
        open_turn = last.type == "message" and last.role == "assistant" and last.status in ("in_progress",
                                                                                             "incomplete")
        shared = self.model_fields_set & GenerationFields.model_fields.keys()
        body: dict[str, Any] = self.model_dump(include=shared, by_alias=True)
        body.update(messages=messages, parallel_tool_calls=self.parallel_tool_calls,
                    add_generation_prompt=not open_turn, continue_final_message=open_turn)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.output_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [t.chat_tool() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        for name in ("service_tier", "prompt_cache_key", "safety_identifier"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return ChatCompletionRequest.model_validate(body), new
