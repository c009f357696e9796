"""The responses POST /v1/responses keeps (`store: true`, OpenAI's default), for `previous_response_id` and
GET / DELETE /v1/responses/{id}: an in-memory LRU of at most `capacity` entries (`--responses-store-size`,
default 1000; 0 keeps nothing and responses say `store: false`). Reading an entry makes it the most recent;
storing past the capacity forgets the least recently used.

An entry holds its response object and its whole conversation as chat messages (inputs and this answer, not
the instructions), so a follow-up renders that conversation plus its own input: the same prefix the previous
turn ran, which recap's prefix cache then serves. A follow-up's list shares its messages with its
predecessor's (references, not copies), and every conversation fit the model's context when it ran, so an
entry's text is bounded by one context's worth. Per process: replicas behind a router do not share it, so a
replica's ids carry its replica id (recap.http.response_ids) and the Ray ingress sends every call naming one of
them to that replica.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from recap.http.response_ids import check_tag, new_response_id
from recap.server.protocol import ChatMessage
from recap.server.responses_api_objects import ResponseObject

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    messages: tuple[ChatMessage, ...]  # the conversation so far, this answer included, instructions excluded
    chars: int  # characters of the messages' text: what rendering a follow-up costs
    input_items: tuple[dict[str, Any], ...] = ()  # its request's input, as /input_items lists it


class ResponseStore:
    """`replica`: the replica id the ids issued here carry (behind the Ray ingress); None: plain ids."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, replica: str | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        check_tag(replica)
        self.capacity = capacity
        self.replica = replica
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def new_id(self) -> str:
        """A fresh response id, naming this store's replica if it has one (whether or not it gets stored)."""
        return new_response_id(self.replica)

    def get(self, rid: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None when it was never stored or has been forgotten."""
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, rid: str, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[rid] = entry
        self._entries.move_to_end(rid)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self._entries.pop(rid, None) is not None
