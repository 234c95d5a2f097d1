"""Server-sent events framing and client-disconnect watching, shared by every streaming route."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from starlette.requests import Request

SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def dumps(obj) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        # json.dumps escapes CR and LF but not these, which str.splitlines (and so httpx's
        # iter_lines) also treats as line ends; they can only occur inside JSON strings.
        text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")
    return text


def data_frame(obj) -> bytes:
    # dumps escapes every line break inside strings, so one frame can never be split.
    return b"data: " + dumps(obj).encode() + b"\n\n"


def event_frame(event: str, obj) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + dumps(obj).encode() + b"\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def on_disconnect(request: Request, callback: Callable[[], None]) -> asyncio.Task:
    """Run `callback` as soon as the client disconnects; cancel the returned task when done."""

    async def watch():
        await wait_for_disconnect(request)
        callback()

    return asyncio.ensure_future(watch())
