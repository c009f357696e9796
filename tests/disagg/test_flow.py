"""recap.disagg.flow over fake upstreams: what each failure returns, and that the held KV is released
whenever the decode side did not answer 200 (the proxy and the Ray P/D ingress both run this flow)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.responses import Response

from recap.disagg.flow import Answer, error_answer, prefill_then_decode, refuse_client_params, upstream_timeout
from recap.http.errors import APIError

HANDLE = {"remote_address": "tcp://127.0.0.1:1", "transfer_id": "t", "mac": "m"}
OK = Answer(200, json.dumps({"kv_transfer_params": HANDLE}).encode(), headers=(("x-origin", "p1"),))


class Fake:
    """An upstream that answers `answer` to post and `response` (or raises it) to respond."""

    name, hint = "the fake", " (hint)"

    def __init__(self, answer: Answer | Exception = OK, response: Response | BaseException | None = None) -> None:
        self.answer, self.response = answer, response or Response(b"decoded", 200)
        self.posted: list[dict[str, Any]] = []
        self.responded: list[dict[str, Any]] = []
        self.released: list[dict[str, Any]] = []

    async def post(self, body: dict[str, Any]) -> Answer:
        self.posted.append(body)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def respond(self, body: dict[str, Any]) -> Response:
        self.responded.append(body)
        if isinstance(self.response, BaseException):
            raise self.response
        return self.response

    def release(self, handle: dict[str, Any]) -> None:
        self.released.append(handle)


def run(body: dict[str, Any], prefill: Fake, decode: Fake) -> Response:
    return asyncio.run(prefill_then_decode(body, prefill, decode))


def test_a_good_request_goes_prefill_then_decode_with_the_handle() -> None:
    prefill, decode = Fake(), Fake()
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    r = run(body, prefill, decode)
    assert r.status_code == 200 and r.body == b"decoded" and r.headers["x-origin"] == "p1"
    assert prefill.posted == [{"prompt": "x", "stream": False, "kv_transfer_params": {"do_remote_decode": True}}]
    assert decode.responded == [{**body, "kv_transfer_params": {**HANDLE, "do_remote_prefill": True}}]
    assert prefill.released == []  # the decode side pulled: nothing to release


def test_a_prefill_error_body_passes_through_and_anything_else_is_a_502() -> None:
    error = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "kv_transfer_params",
                                  "code": None}}).encode()
    r = run({"prompt": "x"}, Fake(Answer(400, error)), decode := Fake())
    assert (r.status_code, r.body) == (400, error) and decode.responded == []
    r = run({"prompt": "x"}, Fake(Answer(500, b"<html>oops</html>", "text/html")), Fake())
    err = json.loads(r.body)["error"]
    assert r.status_code == 502 and err["code"] == "upstream_failed"
    assert err["message"] == "the fake failed (500): <html>oops</html>"


@pytest.mark.parametrize("content", [b"not json", b"[1]", b"{}", b'{"kv_transfer_params": "x"}'])
def test_a_200_without_a_handle_is_a_502(content: bytes) -> None:
    with pytest.raises(APIError) as e:
        run({"prompt": "x"}, Fake(Answer(200, content)), decode := Fake())
    assert (e.value.status, e.value.code) == (502, "upstream_bad_response") and decode.responded == []
    assert e.value.message == "the fake returned no kv_transfer_params (hint)"


def test_an_upstream_failure_is_its_own_error() -> None:
    with pytest.raises(APIError) as e:
        run({"prompt": "x"}, Fake(upstream_timeout("the fake")), Fake())
    assert (e.value.status, e.value.code, e.value.message) == (504, "upstream_timeout", "the fake timed out")


@pytest.mark.parametrize("outcome", [Response(b"refused", 403), APIError("gone", status=503), asyncio.CancelledError()])
def test_the_held_kv_is_released_unless_the_decode_side_answered_200(outcome: Response | BaseException) -> None:
    """A refusal, a failure, or a client that left (the flow cancelled while the decode side works)."""
    prefill = Fake()
    if isinstance(outcome, Response):
        assert run({"prompt": "x"}, prefill, Fake(response=outcome)).status_code == 403
    else:
        with pytest.raises(type(outcome)):
            run({"prompt": "x"}, prefill, Fake(response=outcome))
    assert prefill.released == [HANDLE]


def test_clients_may_not_send_a_handle() -> None:
    refuse_client_params({"prompt": "x"}, "proxy")
    with pytest.raises(APIError) as e:
        refuse_client_params({"kv_transfer_params": {}}, "ingress")
    assert (e.value.status, e.value.param) == (400, "kv_transfer_params")
    assert e.value.message == "kv_transfer_params is set by the ingress, not by clients"


def test_a_decode_side_refusing_the_handle_is_the_front_ends_502() -> None:
    refused = json.dumps({"error": {"message": "expired", "type": "permission_error", "param": "kv_transfer_params",
                                    "code": "kv_transfer_refused"}}).encode()
    r = error_answer("the decode", Answer(403, refused), refusal=True)
    err = json.loads(r.body)["error"]
    assert (r.status_code, err["code"]) == (502, "kv_transfer_refused")
    assert err["message"] == "the decode refused the KV transfer handle (403): expired"
    passed = error_answer("the prefill", Answer(403, refused), refusal=False)  # not a refusal on that side
    assert (passed.status_code, passed.body) == (403, refused)
