"""Thin HTTP routes for Anthropic Messages."""

import asyncio

from fastapi import APIRouter, Request

from mlx_server.api.anthropic.protocol import CountTokensRequest, MessagesRequest

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    return await request.app.state.messages.create(body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    return await asyncio.to_thread(request.app.state.messages.count_tokens, body)
