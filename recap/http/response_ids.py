"""The ids of stored responses (OpenAI's Responses API, `resp_...`) and the replica an id names.

A stored response lives in the store of the process that answered it (recap.server.response_store). A replica
behind the Ray ingress puts its replica id in the ids it issues, `resp_<replica>_<32 hex>`, so the ingress can
send a `previous_response_id` follow-up, a GET or a DELETE to the one replica that holds the response
(recap.cluster.route_input); a single server's ids are plain, `resp_<32 hex>`. An id is opaque to clients
either way: only the `resp_` prefix is OpenAI's.
"""

from __future__ import annotations

import re
import uuid

PREFIX = "resp_"
_TAG = re.compile(r"[A-Za-z0-9]{1,32}")  # a Ray Serve replica id is 8 lowercase letters and digits
_TAGGED = re.compile(r"resp_([A-Za-z0-9]{1,32})_[0-9a-f]{32}")


def check_tag(tag: str | None) -> None:
    """Refuses a replica id that would not read back from the ids it tags."""
    if tag is not None and not _TAG.fullmatch(tag):
        raise ValueError(f"a response id's replica tag must be 1-32 ASCII letters and digits, got {tag!r}")


def new_response_id(tag: str | None = None) -> str:
    """A fresh id: `resp_<tag>_<32 hex>`, or `resp_<32 hex>` without a tag."""
    check_tag(tag)
    return f"{PREFIX}{tag}_{uuid.uuid4().hex}" if tag is not None else f"{PREFIX}{uuid.uuid4().hex}"


def tag_of(response_id: str) -> str | None:
    """The replica tag of an id new_response_id issued with one; None for a plain id or any other string."""
    m = _TAGGED.fullmatch(response_id)
    return m.group(1) if m is not None else None
