"""Routes every client shares: health, the model list, cancellation."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from mlx_server.api.errors import APIError

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


def _model_card(request: Request) -> dict:
    state = request.app.state
    # Which inputs the model takes (OpenRouter's name for it): clients can tell a vision model.
    modalities = ["text", "image", "video"] if state.engine.vision is not None else ["text"]
    return {"id": state.settings.model_id, "object": "model", "created": state.started, "owned_by": "mlx",
            "input_modalities": modalities}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    card = _model_card(request)
    if model_id != card["id"]:
        raise APIError(404, f"model '{model_id}' not found; this server serves '{card['id']}'", param="model", code="model_not_found")
    return card


@router.post("/v1/cancel")
async def cancel(request: Request):
    """Jan's stop button: `{}` cancels every generation, `{"id": ...}` only that one."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise APIError(400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    target = body.get("id")
    if target is not None and not isinstance(target, str):
        raise APIError(400, "id: must be a string (a response id such as chatcmpl-...)", param="id")
    engine = request.app.state.engine
    count = engine.cancel_all() if target is None else engine.cancel_id(target)
    status = "cancelled" if count else "no_active_generation"
    return JSONResponse({"status": status, "cancelled_count": count})
