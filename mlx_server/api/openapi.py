"""/openapi.json as the server really behaves: FastAPI's document from the request models, with
our error statuses and shapes (400, not FastAPI's 422), the response bodies, and SSE.

Responses are built as plain dicts on the hot path, so their schemas are written out here;
the test suite fuzzes the server against this document (tests/hardening/test_openapi_fuzz.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from mlx_server.config import Settings

OPEN_PATHS = {"/health"}
NOT_GENERATION = {"/v1/cancel", "/v1/messages/count_tokens", "/tokenize", "/detokenize"}

_NULLABLE_STRING = {"type": ["string", "null"]}
_REF = "#/components/schemas/"

SCHEMAS = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _NULLABLE_STRING,
                    "code": _NULLABLE_STRING,
                },
            }
        },
    },
    "AnthropicErrorResponse": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "input_modalities": {"type": "array", "items": {"enum": ["text", "image", "video"]},
                                 "description": "what the model takes: image and video for vision models"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": _REF + "Model"}}},
    },
    "CancelRequest": {
        "type": "object",
        "properties": {"id": {**_NULLABLE_STRING, "description": "a response id (chatcmpl-...); absent: cancel every generation"}},
    },
    "CancelResult": {
        "type": "object",
        "required": ["status", "cancelled_count"],
        "properties": {
            "status": {"enum": ["cancelled", "no_active_generation"]},
            "cancelled_count": {"type": "integer", "minimum": 0},
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        },
    },
    "Timings": {
        "type": "object",
        "description": "llama.cpp's timings (Jan's UI reads them); times in milliseconds",
        "required": ["prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"],
        "additionalProperties": {"type": "number"},
    },
    "ToolCall": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "index": {"type": "integer"},
            "id": _NULLABLE_STRING,
            "type": {"const": "function"},
            "function": {"type": "object", "properties": {"name": _NULLABLE_STRING, "arguments": {"type": "string"}}},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "required": ["role", "content", "refusal"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": _NULLABLE_STRING,
                                "refusal": {"type": "null"},
                                "reasoning_content": {"type": "string"},
                                "tool_calls": {"type": "array", "items": {"$ref": _REF + "ToolCall"}},
                            },
                        },
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                    },
                },
            },
            "usage": {"$ref": _REF + "Usage"},
            "timings": {"$ref": _REF + "Timings"},
        },
    },
    "ChatCompletionChunk": {
        "type": "object",
        "description": "the JSON of one `data:` frame of a chat completion stream",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion.chunk"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "delta", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "delta": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": "string"},
                                "reasoning_content": {"type": "string"},
                                "tool_calls": {"type": "array", "items": {"$ref": _REF + "ToolCall"}},
                            },
                        },
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"enum": ["stop", "length", "tool_calls", None]},
                    },
                },
            },
            "usage": {"$ref": _REF + "Usage"},
            "timings": {"$ref": _REF + "Timings"},
        },
    },
    "ChatCompletionEvent": {
        "type": "object",
        "description": (
            "With `stream: true`, the body is server-sent events, each one `data: <JSON>` and a blank line: "
            "ChatCompletionChunk objects, then `data: [DONE]`. An error after the stream started is an "
            "`error: {...}` line (Jan's client reads it), then a `data: {\"error\": {...}}` frame."
        ),
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [{"$ref": _REF + "ChatCompletionChunk"}, {"$ref": _REF + "ErrorResponse"}]},
                    },
                ]
            }
        },
    },
}

def _sse_event(description: str) -> dict:
    """One server-sent event as SSE parsers (and schemathesis) see it: its `event` name and `data` text."""
    return {
        "type": "object",
        "description": description,
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
    }


# (method, path) -> the 200 response, for the routes whose bodies we build by hand.
OK_RESPONSES = {
    ("get", "/health"): {"application/json": {"schema": {"$ref": _REF + "Health"}}},
    ("get", "/v1/models"): {"application/json": {"schema": {"$ref": _REF + "ModelList"}}},
    ("get", "/v1/models/{model_id}"): {"application/json": {"schema": {"$ref": _REF + "Model"}}},
    ("post", "/v1/cancel"): {"application/json": {"schema": {"$ref": _REF + "CancelResult"}}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}},
    ("post", "/v1/chat/completions"): {
        "application/json": {"schema": {"$ref": _REF + "ChatCompletion"}},
        "text/event-stream": {"schema": {"$ref": _REF + "ChatCompletionEvent"}},
    },
    ("post", "/v1/messages"): {
        "application/json": {"schema": {"type": "object", "description": "an Anthropic Message"}},
        "text/event-stream": {"schema": _sse_event("With `stream: true`: Anthropic's `event: <name>` / `data: <JSON>` frames")},
    },
    ("post", "/v1/responses"): {
        "application/json": {"schema": {"type": "object", "description": "an OpenAI Response"}},
        "text/event-stream": {"schema": _sse_event('With `stream: true`: `event: response.*` / `data: <JSON>` frames')},
    },
    ("post", "/v1/completions"): {
        "application/json": {"schema": {"type": "object", "description": "an OpenAI text_completion"}},
        "text/event-stream": {"schema": _sse_event('With `stream: true`: `data: <text_completion JSON>` frames, then `data: [DONE]`')},
    },
}

ERROR_WHY = {
    "400": "The request is invalid; `param` names the field at fault",
    "401": "Missing or wrong API key (Authorization: Bearer, or x-api-key)",
    "404": "Nothing has this id",
    "413": "The request body is larger than the server accepts",
    "429": "Every batch slot and queue place is taken; retry shortly",
    "503": "The generation failed on the server",
}


def install(app: FastAPI, settings: Settings) -> None:
    """Serve our corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, settings)
        return app.openapi_schema

    app.openapi = openapi


def build(app: FastAPI, settings: Settings) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=(
        "OpenAI-compatible chat completions on MLX. Every error body is OpenAI's error object "
        "(Anthropic's on /v1/messages); no input produces a 500."
    ))
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(SCHEMAS)
    if settings.api_key:
        schema["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            _fix_operation(path, method, op, settings)
    return schema


def _fix_operation(path: str, method: str, op: dict, settings: Settings) -> None:
    responses = op.setdefault("responses", {})
    error = _REF + ("AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse")
    statuses = set()
    if responses.pop("422", None) is not None or method == "post":
        statuses.add("400")
    if method == "post":
        statuses.add("413")
        if path not in NOT_GENERATION:
            statuses.update(("429", "503"))
    if "{" in path:  # an id that names nothing
        statuses.add("404")
    if settings.api_key and path not in OPEN_PATHS:
        statuses.add("401")
        op["security"] = [{"bearer": []}, {"apiKey": []}]
    for status in sorted(statuses):
        responses[status] = {"description": ERROR_WHY[status], "content": {"application/json": {"schema": {"$ref": error}}}}
    if (method, path) in OK_RESPONSES:
        responses["200"] = {"description": "OK", "content": OK_RESPONSES[(method, path)]}
    if (method, path) == ("post", "/v1/cancel"):
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": {"$ref": _REF + "CancelRequest"}}}}
