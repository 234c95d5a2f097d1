"""Thin HTTP routes for OpenAI chat completions."""

from fastapi import APIRouter, Request

from mlx_server.api.openai.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await request.app.state.chat.create(body, request)
