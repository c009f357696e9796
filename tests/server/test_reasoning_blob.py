"""reasoning.encrypted_content's blob: round trips any text, tells another server's blob from a damaged one of
recap's, and bounds what a small blob may inflate to."""

from __future__ import annotations

import base64
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recap.server import reasoning_blob
from recap.server.reasoning_blob import MAX_TEXT_BYTES, PREFIX, decode, encode


@given(st.text())
def test_any_text_round_trips(text: str) -> None:
    blob = encode(text)
    assert blob.startswith(PREFIX) and blob.isascii() and decode(blob) == text


def test_another_servers_blob_is_not_read() -> None:
    assert decode("gAAAAABpZtK3mH8xYz2kL9nP4qR7sT0uW") is None  # a Fernet token, as OpenAI's look
    assert decode("") is None


@pytest.mark.parametrize("blob", [
    encode("a think block")[:-6],  # cut
    encode("a think block")[:-4] + "AAAA",  # altered (the checksum fails)
    PREFIX + "!!!!",  # not base64
    PREFIX + base64.urlsafe_b64encode(zlib.compress(b"ok") + b"tail").decode(),  # data after the stream
    PREFIX + base64.urlsafe_b64encode(zlib.compress(b"\xff\xfe")).decode(),  # not UTF-8
    "recap-reasoning-v1.\u00e9",  # not ASCII
], ids=["cut", "altered", "not-base64", "trailing", "not-utf8", "not-ascii"])
def test_a_damaged_blob_of_recaps_is_an_error(blob: str) -> None:
    with pytest.raises(ValueError, match="recap wrote|truncated"):
        decode(blob)


def test_a_blob_that_inflates_past_the_bound_is_refused_without_inflating_it_all() -> None:
    bomb = PREFIX + base64.urlsafe_b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match=f"over {MAX_TEXT_BYTES} bytes"):
        decode(bomb)
    at_bound = encode("x" * MAX_TEXT_BYTES)
    assert decode(at_bound) == "x" * MAX_TEXT_BYTES
    assert reasoning_blob.INCLUDE_REASONING == "reasoning.encrypted_content"  # OpenAI's include value
