"""Thin HTTP routes for OpenAI legacy completions."""

from fastapi import APIRouter, Request

from mlx_server.api.completions.protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await request.app.state.completions.create(body, request)
