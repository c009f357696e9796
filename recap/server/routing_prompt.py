"""What a router hashes (recap.cluster's ingresses): a request body's first prompt as token ids and its cache
salt, tokenized exactly as this app will tokenize it: a chat request rendered with its tools, reasoning effort
and template variables (recap.server.chat_prompt.TemplateInputs, as the replica reads them), a Responses
request as the chat request it is. A request with its own chat template is rendered with the tokenizer's (the
ingress runs no client program): its hashes then match only its own earlier turns' routing."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from recap.http.errors import APIError
from recap.http.json_body import parse_json
from recap.http.wire import GENERATION_ROUTES, RESPONSES_ROUTE
from recap.server.chat_prompt import TemplateInputs
from recap.server.protocol import ChatCompletionRequest
from recap.server.responses_api_request import ResponsesRequest


def prompt_tokens(tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
    """The first prompt's token ids and the cache salt, as the replica will see them; ([], None) when the
    body is not a request this can read (the replica then answers with the proper 4xx), and for a Responses
    request that continues a stored one (its prompt is on the replica its id names: recap.cluster.route_input)."""
    if path not in GENERATION_ROUTES and path != RESPONSES_ROUTE:
        return [], None
    try:
        data = parse_json(body)  # depth, NaN and surrogates refused as the replica refuses them
    except APIError:
        return [], None
    if not isinstance(data, dict):
        return [], None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    if path != "/v1/completions":
        try:
            return _chat_tokens(tokenizer, path, data), salt
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


def _chat_tokens(tokenizer: Any, path: str, data: dict[str, Any]) -> list[int]:
    """Raises ValidationError or APIError for a body the replica refuses."""
    if path == RESPONSES_ROUTE:
        responses = ResponsesRequest.model_validate(data)
        if responses.previous_response_id is not None:
            return []
        chat, _ = responses.chat_request(())
    else:
        chat = ChatCompletionRequest.model_validate(data)
    inputs = TemplateInputs.of(chat)
    if inputs.template is not None:  # rendered with the tokenizer's own template (no client program here)
        inputs = dataclasses.replace(inputs, template=None)
    return inputs.render(tokenizer, chat.messages).token_ids
