"""What a router hashes (recap.cluster's ingresses): a request body's first prompt as token ids and its cache
salt, tokenized exactly as this app will tokenize it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from recap.http.errors import APIError
from recap.http.json_body import parse_json
from recap.http.wire import GENERATION_ROUTES
from recap.server.chat_prompt import build_chat_input
from recap.server.protocol import ChatCompletionRequest


def prompt_tokens(tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
    """The first prompt's token ids and the cache salt, as the replica will see them; ([], None) when the
    body is not a request this can read (the replica then answers with the proper 4xx), and for a route that
    generates from no such prompt (a Responses body is left unparsed: the ingress reads its one field itself)."""
    if path not in GENERATION_ROUTES:
        return [], None
    try:
        data = parse_json(body)  # depth, NaN and surrogates refused as the replica refuses them
    except APIError:
        return [], None
    if not isinstance(data, dict):
        return [], None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    if path == "/v1/chat/completions":
        try:
            return build_chat_input(tokenizer, ChatCompletionRequest.model_validate(data).messages).token_ids, salt
        except (ValidationError, APIError):
            return [], None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str) and prompt:
        return list(tokenizer.encode(prompt, add_special_tokens=False)), salt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), salt
    return [], None
