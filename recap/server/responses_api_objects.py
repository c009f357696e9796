"""POST /v1/responses response models: the `response` object, its output items and usage, as OpenAI's SDK
types them (openai.types.responses), and how one is built from a request and an answer.

An answer's output is a `reasoning` item holding its think block (with --reasoning-parser, when it thought:
vLLM's shape, the text as one `reasoning_text` content part and an empty `summary`; with `include:
["reasoning.encrypted_content"]` the text again as `encrypted_content`, recap.server.reasoning_blob), then a
`message` item
holding its text (when it has text, or neither reasoning nor calls) followed by one `function_call` item per
tool call. Its status is "completed", "incomplete" when max_output_tokens cut it
(`incomplete_details.reason` "max_output_tokens"), or "failed" when generation failed midway (a grammar that
stopped matching: `error`). `output_text` is not a field: OpenAI's SDK computes it from the output.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from recap.sampling_params import SamplingParams
from recap.server import reasoning_blob
from recap.server.responses import ChatTokenLogprob, Usage
from recap.server.responses_api_request import FunctionChoice, InputItem, ResponsesRequest
from recap.server.tools import ToolCall

STATUS = Literal["completed", "incomplete", "failed", "in_progress"]


def new_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # the Responses API's Logprob: chat's shape


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"

    @classmethod
    def of(cls, call: ToolCall) -> OutputFunctionCall:
        return cls(id=new_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The think block (recap generates no summaries: `summary` is empty, as vLLM's)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


def as_input(output: list[OutputItem]) -> list[InputItem]:
    """Output items as the input items a client sends back (how a stored answer joins its conversation)."""
    return [InputItem.model_validate(item.model_dump(exclude_none=isinstance(item, OutputReasoning)))
            for item in output]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from recap's prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the think block's tokens (--reasoning-parser); 0 without a parser


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage, reasoning_tokens: int = 0) -> ResponsesUsage:
        cached = usage.prompt_tokens_details.cached_tokens
        return cls(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                   output_tokens=usage.completion_tokens,
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                   total_tokens=usage.total_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str = "server_error"
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: STATUS
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    # the request's parameters, echoed (sampling as applied: the model's generation_config fills unset ones)
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    user: str | None
    background: bool = False
    service_tier: str = "default"
    top_logprobs: int = 0
    max_tool_calls: int | None = None
    safety_identifier: str | None
    prompt_cache_key: str | None


@dataclass(frozen=True)
class ResponseHead:
    """What every snapshot of one response shares (created, in progress, final): its id and the echo of its
    request."""

    rid: str
    created_at: int
    model: str
    echo: dict[str, Any]
    encrypted_reasoning: bool = False  # reasoning items carry `encrypted_content` (the request included it)

    def reasoning_item(self, rid: str, text: str, status: str) -> OutputReasoning:
        """A finished (or cut: `status` "incomplete") reasoning item of this response."""
        blob = reasoning_blob.encode(text) if self.encrypted_reasoning else None
        return OutputReasoning(id=rid, content=[ReasoningText(text=text)], encrypted_content=blob,
                               status=status)  # type: ignore[arg-type]  # pydantic checks the literal

    def snapshot(self, status: STATUS, output: list[OutputItem] | None = None, usage: Usage | None = None,
                 finish: str | None = None, error: str | None = None, reasoning_tokens: int = 0) -> ResponseObject:
        return ResponseObject(
            id=self.rid, created_at=self.created_at, model=self.model, status=status, output=output or [],
            usage=None if usage is None else ResponsesUsage.of(usage, reasoning_tokens),
            incomplete_details=IncompleteDetails() if finish == "length" else None,
            error=None if error is None else ResponseError(message=error), **self.echo)


def response_head(rid: str, req: ResponsesRequest, params: SamplingParams, model: str, stored: bool) -> ResponseHead:
    """`params`: the sampling the request runs with; `stored`: whether the response will be kept."""
    choice: str | dict[str, Any] = "auto"
    if isinstance(req.tool_choice, FunctionChoice):
        choice = req.tool_choice.model_dump()
    elif req.tool_choice is not None:
        choice = req.tool_choice
    text = {"format": {"type": "text"}} if req.text is None or req.text.format is None else {
        "format": req.text.format.model_dump(exclude_none=True, by_alias=True)}
    echo = dict(
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
        reasoning={"effort": req.reasoning.effort if req.reasoning else None,
                   "summary": req.reasoning.summary if req.reasoning else None},
        store=stored, temperature=params.temperature, text=text,
        tool_choice=choice, tools=[t.model_dump() for t in req.tools or []], top_p=params.top_p, user=req.user,
        service_tier=req.service_tier or "default", safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key, top_logprobs=req.top_logprobs or 0)
    return ResponseHead(rid, int(time.time()), model, echo, req.encrypted_reasoning)


def status_of(finish: str | None) -> STATUS:
    if finish == "length":
        return "incomplete"
    return "failed" if finish == "error" else "completed"


def output_items(head: ResponseHead, content: str | None, calls: list[ToolCall], finish: str | None,
                 reasoning: str | None = None, logprobs: list[ChatTokenLogprob] | None = None) -> list[OutputItem]:
    """A whole answer's items: its reasoning, its text as a message (unless it is all calls, or all reasoning),
    then its calls. The last item is incomplete when max_output_tokens (or a failure) cut it. `logprobs`: the
    content tokens', when included."""
    cut = finish in ("length", "error")
    items: list[OutputItem] = []
    if reasoning is not None:
        last = content is None and not calls
        items.append(head.reasoning_item(new_id("rs"), reasoning, "incomplete" if cut and last else "completed"))
    if content is not None or not (calls or reasoning is not None):
        status = "incomplete" if finish in ("length", "error") and not calls else "completed"
        part = OutputText(text=content or "", logprobs=logprobs or [])
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[part]))
    items.extend(OutputFunctionCall.of(c) for c in calls)
    return items
