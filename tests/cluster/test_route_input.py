"""A replica's response ids carry its replica id, and the ingress pins every call about a stored response to
the replica that stored it (recap.http.response_ids, recap.cluster.route_input); no Ray needed."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from recap.cluster.route_input import pinned_replica, route_input
from recap.http.response_ids import check_tag, new_response_id, tag_of
from recap.server.response_store import ResponseStore
from recap.server.routing_prompt import prompt_tokens

REPLICA = "k3x9q2ab"  # the shape of a Ray Serve replica id


def test_a_tagged_id_names_its_replica_and_a_plain_one_none() -> None:
    rid = ResponseStore(4, REPLICA).new_id()
    assert re.fullmatch(r"resp_k3x9q2ab_[0-9a-f]{32}", rid) and tag_of(rid) == REPLICA
    plain = ResponseStore(4).new_id()
    assert re.fullmatch(r"resp_[0-9a-f]{32}", plain) and tag_of(plain) is None  # a single server's ids
    assert new_response_id(REPLICA) != new_response_id(REPLICA)
    for other in ("resp_nope", "resp_a_b", f"msg_{REPLICA}_{'0' * 32}", f"resp_{REPLICA}_{'0' * 31}",
                  f"resp_{REPLICA}_{'G' * 32}", f"resp_a-b_{'0' * 32}", f" {rid}", ""):
        assert tag_of(other) is None, other


@pytest.mark.parametrize("tag", ["", "a_b", "a-b", "x" * 33, "é"])
def test_a_tag_that_would_not_read_back_is_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="replica tag"):
        check_tag(tag)
    with pytest.raises(ValueError, match="replica tag"):
        ResponseStore(4, tag)


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "input": "Hi", **fields}).encode()


TAGGED = f"resp_{REPLICA}_{'a' * 32}"
PLAIN = f"resp_{'a' * 32}"


@pytest.mark.parametrize("method,path,body,pin", [
    ("POST", "/v1/responses", _body(previous_response_id=TAGGED), REPLICA),  # a follow-up
    ("GET", f"/v1/responses/{TAGGED}", b"", REPLICA),
    ("DELETE", f"/v1/responses/{TAGGED}", b"", REPLICA),
    ("GET", f"/v1/responses/{TAGGED}/input_items", b"", REPLICA),  # any call about the stored response
    ("POST", "/v1/responses", _body(), None),  # a first turn: routed by load
    ("POST", "/v1/responses", _body(previous_response_id=PLAIN), None),  # not a replica's id: not found anywhere
    ("POST", "/v1/responses", _body(previous_response_id=None), None),
    ("POST", "/v1/responses", _body(previous_response_id=[TAGGED]), None),  # the replica answers the 400
    ("POST", "/v1/responses", b'{"previous_response_id": "' + TAGGED.encode() + b'"', None),  # not JSON
    ("POST", "/v1/responses", json.dumps([TAGGED]).encode(), None),
    ("GET", f"/v1/responses/{PLAIN}", b"", None),
    ("GET", "/v1/responses/", b"", None),
    ("POST", "/v1/chat/completions", _body(previous_response_id=TAGGED), None),  # no Responses call
    ("GET", f"/v1/models/{TAGGED}", b"", None),
])
def test_the_ingress_pins_calls_about_a_stored_response(method: str, path: str, body: bytes, pin: str | None
                                                        ) -> None:
    assert pinned_replica(method, path, body) == pin


class _API:
    """The replicas' API as the ingress uses it: its prompt reader, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prompt_tokens(self, tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
        self.calls.append(path)
        return [1, 2, 3], "salt"


def test_a_pinned_call_reads_no_prompt_and_the_others_route_by_prompt() -> None:
    api = _API()
    follow = route_input(api, None, "POST", "/v1/responses", _body(previous_response_id=TAGGED), "checkpoint")  # type: ignore[arg-type]
    assert follow == {"pin": REPLICA, "policy": "checkpoint"} and api.calls == []
    get = route_input(api, None, "GET", f"/v1/responses/{TAGGED}", b"", "load")  # type: ignore[arg-type]
    assert get == {"pin": REPLICA, "policy": "load"} and api.calls == []
    chat = route_input(api, None, "POST", "/v1/chat/completions", b"{}", "checkpoint")  # type: ignore[arg-type]
    assert chat == {"tokens": [1, 2, 3], "cache_salt": "salt", "policy": "checkpoint"}
    health = route_input(api, None, "GET", "/health", b"", "checkpoint")  # type: ignore[arg-type]
    assert health == {"tokens": [], "cache_salt": None, "policy": "checkpoint"}
    assert api.calls == ["/v1/chat/completions"]


def test_the_api_reads_no_prompt_from_a_responses_body() -> None:
    """The ingress reads a Responses body's one field itself: the API's prompt reader does not parse it again."""
    assert prompt_tokens(None, "/v1/responses", b'{"prompt": [1, 2, 3]}') == ([], None)
    assert prompt_tokens(None, "/v1/completions", b'{"prompt": [1, 2, 3]}') == ([1, 2, 3], None)
