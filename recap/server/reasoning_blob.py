"""`include: ["reasoning.encrypted_content"]`: a reasoning item's text as an opaque string that a stateless client
(`store: false`, no `previous_response_id`: Codex CLI, the Agents SDK) sends back in its next turn's input, so the
think block joins the conversation with no stored response on any server.

Encoded, not encrypted: recap holds no key, and the same text is in the item's `content` already. The string is
self-describing (`recap-reasoning-v1.` + urlsafe base64 of the zlib-compressed UTF-8 text), so an input item
carrying another provider's blob is told apart (its summary stands in for it) from one of recap's that was cut or
altered (a 400: silently dropping part of a conversation would change the prompt the client thinks it sent).
"""

from __future__ import annotations

import base64
import binascii
import zlib

INCLUDE_REASONING = "reasoning.encrypted_content"
PREFIX = "recap-reasoning-v1."
MAX_TEXT_BYTES = 4 << 20  # a decoded think block past this is refused (a small blob may inflate to anything)


def encode(text: str) -> str:
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"), 6)).decode("ascii")


def decode(blob: str) -> str | None:
    """The text of one of recap's blobs; None for another server's. Raises ValueError for a damaged one of recap's
    or one that inflates past MAX_TEXT_BYTES."""
    if not blob.startswith(PREFIX):
        return None
    try:
        packed = base64.urlsafe_b64decode(blob[len(PREFIX):].encode("ascii"))
        inflate = zlib.decompressobj()
        raw = inflate.decompress(packed, MAX_TEXT_BYTES + 1)
        if len(raw) > MAX_TEXT_BYTES:
            raise ValueError(f"a reasoning text over {MAX_TEXT_BYTES} bytes")
        if not inflate.eof or inflate.unused_data:
            raise ValueError("truncated or followed by other data")
        return raw.decode("utf-8")
    except (binascii.Error, zlib.error, UnicodeError) as e:
        raise ValueError(f"not a reasoning blob recap wrote ({type(e).__name__})") from None
