"""Thin HTTP routes for OpenAI Responses."""

from fastapi import APIRouter, Request

from mlx_server.api.responses.protocol import ResponsesRequest

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return request.app.state.responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    return request.app.state.responses.delete(response_id)
