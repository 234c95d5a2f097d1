"""POST /tokenize and /detokenize, in the shapes llama.cpp's and vLLM's servers use."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import Field

from mlx_server.api.chat_like import prompt_tokens
from mlx_server.api.errors import APIError
from mlx_server.api.openai.protocol import ChatCompletionRequest, ChatMessage
from mlx_server.api.schema import Lenient

router = APIRouter()


class TokenizeRequest(Lenient):
    content: str | None = None  # llama.cpp
    prompt: str | None = None  # vLLM
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # vLLM: a chat, rendered by the template
    tools: list[dict] | None = None
    add_special: bool | None = None  # llama.cpp's name, default false
    add_special_tokens: bool | None = None  # vLLM's name, default true
    with_pieces: bool | None = None


class DetokenizeRequest(Lenient):
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """`{"tokens": [...], "count": n, "max_model_len": ctx}`; with_pieces: tokens are `{"id", "piece"}`."""
    return await asyncio.to_thread(_tokenize, body, request.app.state.chat)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """`{"content": text}` (llama.cpp), also as `prompt` (vLLM)."""
    tokenizer = request.app.state.engine.tokenizer
    vocab_size = request.app.state.chat.prompt.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (0..{vocab_size - 1})", param="tokens")
    text = tokenizer.decode(body.tokens)
    return {"content": text, "prompt": text}


def _tokenize(body: TokenizeRequest, chat) -> dict:
    given = [name for name in ("content", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(400, "send exactly one of content, prompt or messages", param=given[1] if given else "content")
    if body.messages is not None:
        req = ChatCompletionRequest(model="", messages=body.messages, tools=body.tools)
        tokens = prompt_tokens(chat, req)
    else:
        special = body.add_special if body.add_special is not None else body.add_special_tokens
        if special is None:
            special = body.prompt is not None
        tokens = chat.engine.tokenizer.encode(body.content if body.prompt is None else body.prompt, add_special_tokens=special)
    out = [{"id": t, "piece": chat.engine.tokenizer.decode([t])} for t in tokens] if body.with_pieces else tokens
    return {"tokens": out, "count": len(tokens), "max_model_len": chat.settings.ctx_size}
