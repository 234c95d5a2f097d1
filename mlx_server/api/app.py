"""The FastAPI application: routes, the auth/body-size guard, and errors in protocol shapes."""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from mlx_server.api import metrics, openapi, system
from mlx_server.api.limits import has_lone_surrogate
from mlx_server.api.errors import APIError, error_response_for, status_error, unauthorized, validation_error
from mlx_server.api.anthropic.router import router as anthropic_router
from mlx_server.api.anthropic.serving import MessagesServing
from mlx_server.api.completions.router import router as completions_router
from mlx_server.api.completions.serving import CompletionServing
from mlx_server.api.openai.router import router as openai_router
from mlx_server.api.openai.serving import ChatServing
from mlx_server.api.responses.router import router as responses_router
from mlx_server.api.responses.serving import ResponsesServing
from mlx_server.api.tokenize import router as tokenize_router
from mlx_server.config import Settings
from mlx_server.engine.scheduler import Engine
from mlx_server.log import logger

OPEN_PATHS = {"/health"}
# A body larger than this is not even read to the end: the connection is closed after the 413.
DRAIN_LIMIT = 64 * 1024 * 1024


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    app = FastAPI(title="mlx-server", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.settings = settings
    app.state.started = int(time.time())
    app.state.chat = ChatServing(engine, settings)
    app.state.messages = MessagesServing(app.state.chat)
    app.state.responses = ResponsesServing(app.state.chat)
    app.state.completions = CompletionServing(app.state.chat)
    app.include_router(system.router)
    if settings.metrics:
        app.state.metrics = metrics.make_registry(engine)
        app.include_router(metrics.router)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(completions_router)
    app.include_router(tokenize_router)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response_for(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response_for(request.url.path, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route for {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        response = error_response_for(request.url.path, status_error(exc.status_code, message))
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response_for(request.url.path, APIError(500, "internal server error", type="server_error"))

    app.add_middleware(Guard, settings=settings)
    if settings.cors_origins:
        # Outside the guard: a browser's preflight OPTIONS request carries no credentials.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"], allow_headers=["*"]
        )
    if settings.metrics:
        app.add_middleware(metrics.RequestMetrics, registry=app.state.metrics)
    openapi.install(app, settings)
    return app


class Guard:
    """Pure ASGI middleware (no per-chunk overhead on streams): API key, body-size limit, and
    bodies that are not valid Unicode."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.key = settings.api_key.encode()
        self.limit = settings.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.key and path not in OPEN_PATHS and not self._authorized(headers):
            return await self._reply(scope, send, unauthorized())
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._drain(receive)
            return await self._reply(scope, send, self._too_large())
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body, complete = await self._read_body(receive)
        if not complete:
            return await self._reply(scope, send, self._too_large())
        if has_lone_surrogate(body):
            return await self._reply(scope, send, APIError(400, "the request body is not valid Unicode: it holds an unpaired UTF-16 surrogate"))
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict) -> bool:
        bearer = headers.get(b"authorization", b"")
        token = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else b""
        given = headers.get(b"x-api-key", b"")
        # Compare both, always, so timing tells nothing about which header or how much matched.
        ok_bearer = hmac.compare_digest(token, self.key)
        ok_header = hmac.compare_digest(given, self.key)
        return ok_bearer or ok_header

    def _too_large(self) -> APIError:
        return status_error(413, f"the request body is larger than {self.limit // (1024 * 1024)} MiB")

    async def _read_body(self, receive) -> tuple[bytes, bool]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._drain(receive, size)
                return b"", False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    @staticmethod
    async def _drain(receive, seen: int = 0) -> None:
        """Read (and drop) the rest of an oversized body so the client sees our 413, not a reset."""
        while seen <= DRAIN_LIMIT:
            message = await receive()
            seen += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return

    @staticmethod
    async def _reply(scope, send, err: APIError) -> None:
        response = error_response_for(scope["path"], err)
        await response({**scope, "type": "http"}, _no_receive, send)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _no_receive():
    return {"type": "http.disconnect"}
