"""`logit_bias` as OpenAI sends it (token ids as JSON object keys) -> {token id: bias}.

A key must be a token id in canonical decimal ("0", "7", "1234"): `int()` would also take " 7 ", "1_0",
"07", "+7" and non-ASCII digits ("\u0665"), and two spellings of one id would collapse silently into one
entry (JSON's own duplicate keys are refused by the body parser, recap.http.json_body). Ids are never
negative, so no sign is allowed; out-of-vocabulary ids are the engine's 400 (recap.engine.input_processor).
"""

from __future__ import annotations

import re

# ASCII digits, no sign, no leading zero (one id, one spelling), at most 18 digits (an int64).
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def logit_bias_by_id(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Raises ValueError naming the first key that is not a canonical token id."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not TOKEN_ID_KEY.fullmatch(key):
            raise ValueError(f"logit_bias: key {key!r} is not a token id (a non-negative decimal integer written "
                             "without sign, spaces, separators or leading zeros)")
        out[int(key)] = value
    return out
