"""A streamed POST /v1/responses answer as the Responses API's server-sent events, each with its
`sequence_number`, in OpenAI's order:

    response.created, response.in_progress,
    [the message] response.output_item.added, response.content_part.added, response.output_text.delta (each
        piece of text), response.output_text.done, response.content_part.done, response.output_item.done,
    [each call] response.output_item.added, response.function_call_arguments.delta (the whole arguments),
        response.function_call_arguments.done, response.output_item.done,
    response.completed | response.incomplete | response.failed.

The message opens at the answer's first text and closes before its first call or at the end (an answer with
neither text nor calls still has its empty message, as the answer that is not streamed). Tool calls are read
from the text as chat streams them (recap.server.tool_stream): each call goes out once its text is complete,
its arguments in one delta. An error after the 200 is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from recap.engine.outputs import RequestOutput
from recap.server.errors import from_exception
from recap.server.protocol import ChatCompletionRequest
from recap.server.responses_api_objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseHead,
    ResponseObject,
    new_id,
    status_of,
)
from recap.server.serving import usage
from recap.server.tool_stream import ToolCallStream
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
    """The output items of one answer as they stream: `items` holds the finished ones."""

    def __init__(self, event: EventWriter) -> None:
        self.event = event
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None  # the open message
        self._text: list[str] = []

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        events = [] if self._message is not None else self._open()
        assert self._message is not None
        self._text.append(piece)
        events.append(self.event("response.output_text.delta", item_id=self._message.id,
                                 output_index=len(self.items), content_index=0, delta=piece, logprobs=[]))
        return events

    def call(self, call: ToolCall) -> list[str]:
        events = self._close("completed")
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
        """Closes the answer: the open message (incomplete when cut short), or an empty one if nothing came."""
        events = self._open() if not self.items and self._message is None else []
        return events + self._close("incomplete" if finish in ("length", "error") else "completed")

    def _open(self) -> list[str]:
        self._message = message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        index = len(self.items)
        return [self.event("response.output_item.added", output_index=index, item=message),
                self.event("response.content_part.added", item_id=message.id, output_index=index, content_index=0,
                           part=OutputText(text=""))]

    def _close(self, status: str) -> list[str]:
        if self._message is None:
            return []
        part, index = OutputText(text="".join(self._text)), len(self.items)
        message = self._message.model_copy(update={"status": status, "content": [part]})
        events = [
            self.event("response.output_text.done", item_id=message.id, output_index=index, content_index=0,
                       text=part.text, logprobs=[]),
            self.event("response.content_part.done", item_id=message.id, output_index=index, content_index=0,
                       part=part),
            self.event("response.output_item.done", output_index=index, item=message),
        ]
        self.items.append(message)
        self._message, self._text = None, []
        return events


async def response_events(
    chat: ChatCompletionRequest, tool_parser: str | None, head: ResponseHead, first: tuple[int, RequestOutput],
    it: AsyncGenerator[tuple[int, RequestOutput], None], keep: Callable[[ResponseObject], None],
) -> AsyncIterator[str]:
    """The events of one answer (`first`, then the rest of `it`); `keep` stores the final response."""
    event = EventWriter()
    out = StreamedOutput(event)
    choice = chat.effective_tool_choice
    calls_in = ToolCallStream(chat.tools or [], choice, tool_parser) if chat.tools and choice != "none" else None
    try:
        yield event("response.created", response=head.snapshot("in_progress"))
        yield event("response.in_progress", response=head.snapshot("in_progress"))
        final: RequestOutput | None = None
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            final = item[1]
            o = final.outputs[0]
            content, calls = (o.text_delta, []) if calls_in is None else calls_in.feed(o.text_delta)
            if calls_in is not None and o.finish_reason is not None:
                more_content, more_calls = calls_in.finish()
                content, calls = content + more_content, calls + more_calls
            for frame in out.text(content) + [f for c in calls for f in out.call(c)]:
                yield frame
            item = await anext(it, None)
        assert final is not None and final.finished
        o = final.outputs[0]
        for frame in out.finish(o.finish_reason):
            yield frame
        status = status_of(o.finish_reason)
        response = head.snapshot(status, out.items, usage([final]), o.finish_reason,
                                 error=(final.error or "generation failed") if status == "failed" else None)
        keep(response)
        yield event(_LAST_EVENT[status], response=response)
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-stream, as OpenAI does
        err = from_exception(e)
        yield event("error", code=err.code, message=err.message, param=err.param)
    finally:
        await it.aclose()
