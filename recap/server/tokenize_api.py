"""vLLM's utility endpoints: POST /tokenize (a prompt or chat messages -> token ids), POST /detokenize,
GET /version and GET /v1/models/{id}."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, model_validator

import recap
from recap.http.errors import APIError
from recap.server.chat_prompt import build_chat_input
from recap.server.protocol import ChatMessage, _Strict
from recap.server.request_body import parse_request
from recap.server.responses import ModelCard
from recap.server.serving import ServerState


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False  # recap encodes prompts without them, so the count matches generation
    add_generation_prompt: bool = True  # chat only: the chat endpoint's flags of the same names
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(send add_generation_prompt: false to continue the final message)")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


def _tokenize(state: ServerState, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """Token ids (and their strings) of a prompt or a chat; may be large, so it runs off the event loop."""
    tok = state.tokenizer
    if req.messages is not None:
        ids = build_chat_input(tok, req.messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message).token_ids
    else:
        ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return ids, ([state.token_text(t) for t in ids] if req.return_token_strs else None)


def add_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = await parse_request(request, TokenizeRequest, state)
        state.check_model(req.model)
        size = len(await request.body())  # a prompt, or messages whose count and markup cost as much as text
        ids, strs = await state.offload.run(size, _tokenize, state, req)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await parse_request(request, DetokenizeRequest, state)
        state.check_model(req.model)
        vocab = state.engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is out of vocabulary (vocab size {vocab})", param="tokens")
        return {"prompt": await state.offload.run(len(req.tokens), state.tokenizer.decode, req.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": recap.__version__}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len).model_dump()
