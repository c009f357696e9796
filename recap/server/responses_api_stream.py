"""A streamed POST /v1/responses answer as the Responses API's server-sent events, each with its
`sequence_number`, in OpenAI's order:

    response.created, response.in_progress,
    [the reasoning, with --reasoning-parser] response.output_item.added, response.content_part.added (a
        reasoning_text part), response.reasoning_text.delta (each piece), response.reasoning_text.done,
        response.content_part.done, response.output_item.done,
    [the message] response.output_item.added, response.content_part.added, response.output_text.delta (each
        piece of text), response.output_text.done, response.content_part.done, response.output_item.done,
    [each call] response.output_item.added, response.function_call_arguments.delta (the whole arguments),
        response.function_call_arguments.done, response.output_item.done,
    response.completed | response.incomplete | response.failed.

The reasoning item opens at the first reasoning text and closes when the think block ends; the message opens at
the answer's first text and closes before its first call or at the end (an answer with no reasoning, text or
call still has its empty message, as the answer that is not streamed). Tool calls are read
from the text as chat streams them (recap.server.tool_stream): each call goes out once its text is complete,
its arguments in one delta. An error after the 200 is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from recap.engine.outputs import RequestOutput
from recap.server.answer_stream import AnswerStream
from recap.server.chat import ChatRun, answer_stream
from recap.server.errors import from_exception
from recap.server.protocol import ChatCompletionRequest
from recap.server.reasoning import reasoning_tokens
from recap.server.responses import ChatTokenLogprob
from recap.server.responses_api_logprobs import StreamedLogprobs, delta_shape
from recap.server.responses_api_objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseHead,
    ResponseObject,
    new_id,
    status_of,
)
from recap.server.serving import ServerState, usage
from recap.server.tools import ToolCall

_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


class EventWriter:
    """Numbers one stream's events and renders each as an SSE frame (`event:` names its type, as OpenAI's)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data: dict[str, Any] = {"type": kind, "sequence_number": self.sequence}
        data.update({k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()})
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamedOutput:
    """The output items of one answer as they stream: `items` holds the finished ones. `logprobs`: the content
    tokens' logprobs, when the request includes them (they go out with the text events)."""

    def __init__(self, event: EventWriter, head: ResponseHead, logprobs: StreamedLogprobs | None = None) -> None:
        self.event, self.head, self.logprobs = event, head, logprobs
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None  # the open message
        self._text: list[str] = []
        self._logprobs: list[ChatTokenLogprob] = []  # the open message's
        self._reasoning: OutputReasoning | None = None  # the open reasoning item
        self._thought: list[str] = []

    def reasoning(self, piece: str) -> list[str]:
        if not piece:
            return []
        events = [] if self._reasoning is not None else self._open_reasoning()
        assert self._reasoning is not None
        self._thought.append(piece)
        events.append(self.event("response.reasoning_text.delta", item_id=self._reasoning.id,
                                 output_index=len(self.items), content_index=0, delta=piece))
        return events

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        events = self._close_reasoning("completed")
        events += [] if self._message is not None else self._open()
        assert self._message is not None
        self._text.append(piece)
        return events + self._delta(piece)

    def _delta(self, piece: str) -> list[str]:
        assert self._message is not None
        taken = self.logprobs.take() if self.logprobs is not None else []
        self._logprobs += taken
        return [self.event("response.output_text.delta", item_id=self._message.id, output_index=len(self.items),
                           content_index=0, delta=piece, logprobs=delta_shape(taken))]

    def call(self, call: ToolCall) -> list[str]:
        events = self._close_reasoning("completed") + self._close("completed")
        item, index = OutputFunctionCall.of(call), len(self.items)
        added = item.model_copy(update={"arguments": "", "status": "in_progress"})
        events += [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                       delta=item.arguments),
            self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                       arguments=item.arguments, name=item.name),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.items.append(item)
        return events

    def finish(self, finish: str | None) -> list[str]:
        """Closes the answer: the open item (incomplete when cut short), or an empty message if nothing came."""
        status = "incomplete" if finish in ("length", "error") else "completed"
        events = self._close_reasoning(status)
        events += self._open() if not self.items and self._message is None else []
        return events + self._close(status)

    def _open_reasoning(self) -> list[str]:
        self._reasoning = item = OutputReasoning(id=new_id("rs"), content=[], status="in_progress")
        return self._added(item, ReasoningText(text=""))

    def _close_reasoning(self, status: str) -> list[str]:
        if self._reasoning is None:
            return []
        item = self.head.reasoning_item(self._reasoning.id, "".join(self._thought), status)
        part = item.content[0]
        self._reasoning, self._thought = None, []
        return self._done(item, part, "response.reasoning_text.done")

    def _open(self) -> list[str]:
        self._message = message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        return self._added(message, OutputText(text=""))

    def _close(self, status: str) -> list[str]:
        if self._message is None:
            return []
        # tokens whose text was held back or parsed into calls: their logprobs still go out, with no text
        events = self._delta("") if self.logprobs is not None and self.logprobs.ready else []
        part = OutputText(text="".join(self._text), logprobs=self._logprobs)
        message = self._message.model_copy(update={"status": status, "content": [part]})
        self._message, self._text, self._logprobs = None, [], []
        return events + self._done(message, part, "response.output_text.done", logprobs=delta_shape(part.logprobs))

    def _added(self, item: OutputReasoning | OutputMessage, part: ReasoningText | OutputText) -> list[str]:
        """An item opens with its one (empty) content part."""
        index = len(self.items)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                           part=part)]

    def _done(self, item: OutputReasoning | OutputMessage, part: ReasoningText | OutputText, text_done: str,
              **extra: object) -> list[str]:  # fmt: skip
        """An item closes: its text's done event, its part's, its own; it then joins the output."""
        index = len(self.items)
        events = [
            self.event(text_done, item_id=item.id, output_index=index, content_index=0, text=part.text, **extra),
            self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                       part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.items.append(item)
        return events


async def response_events(
    state: ServerState, chat: ChatCompletionRequest, run: ChatRun, head: ResponseHead, first: tuple[int, RequestOutput],
    keep: Callable[[ResponseObject], None],
) -> AsyncIterator[str]:
    """The events of one answer (`first`, then the rest of the run's stream); `keep` stores the final response."""
    event = EventWriter()
    answer = answer_stream(state, chat, run.reasoning)
    logprobs = None if not chat.logprobs else StreamedLogprobs(state.token_text, chat.top_logprobs or 0,
                                                               None if answer is None else answer.reasoning)
    out = StreamedOutput(event, head, logprobs)
    it = run.it
    try:
        yield event("response.created", response=head.snapshot("in_progress"))
        yield event("response.in_progress", response=head.snapshot("in_progress"))
        final: RequestOutput | None = None
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            final = item[1]
            o = final.outputs[0]
            if logprobs is not None:
                logprobs.add(o.token_ids_delta, o.logprobs_delta)
            for frame in _frames(out, answer, o.text_delta, o.finish_reason is not None, chat.include_reasoning):
                yield frame
            item = await anext(it, None)
        assert final is not None and final.finished
        o = final.outputs[0]
        for frame in out.finish(o.finish_reason):
            yield frame
        status = status_of(o.finish_reason)
        thought = 0
        if answer is not None and answer.reasoning is not None:
            thought = reasoning_tokens([state.token_text(t) for t in o.token_ids], answer.reasoning)
        response = head.snapshot(status, out.items, usage([final]), o.finish_reason,
                                 error=(final.error or "generation failed") if status == "failed" else None,
                                 reasoning_tokens=thought)
        keep(response)
        yield event(_LAST_EVENT[status], response=response)
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-stream, as OpenAI does
        err = from_exception(e)
        yield event("error", code=err.code, message=err.message, param=err.param)
    finally:
        await it.aclose()


def _frames(out: StreamedOutput, answer: AnswerStream | None, text: str, last: bool, with_reasoning: bool
            ) -> list[str]:
    """The events of one step's text: its reasoning, content and calls (the held-back rest when `last`)."""
    if answer is None:
        return out.text(text)
    pieces = answer.step(text, last)
    frames = out.reasoning(pieces.reasoning) if with_reasoning else []
    return frames + out.text(pieces.content) + [f for c in pieces.calls for f in out.call(c)]
