"""Run a protocol's output translation on scripted ChatOutput deltas, without a model, and read
its SSE back; so tool-call and thinking output is tested before any model produces it."""

from __future__ import annotations

import asyncio
import json

from types import SimpleNamespace

import httpx2

from mlx_server.api.openai.serving import ChatServing
from mlx_server.config import Settings
from mlx_server.engine.request import GenerationEvent, Timings, Usage
from mlx_server.text.chat_output import OutputDelta


def chat_serving(tokenizer) -> ChatServing:
    """The chat path over a real tokenizer and no model: enough to render and check requests."""
    return ChatServing(SimpleNamespace(tokenizer=tokenizer, vision=None), Settings(model_id="m"))


class ScriptedOutput:
    """Stands in for ChatOutput: each fed event yields the next scripted delta."""

    def __init__(self, deltas: list[OutputDelta]):
        self._deltas = list(deltas)

    def feed(self, text: str) -> OutputDelta:
        return self._deltas.pop(0) if self._deltas else OutputDelta()

    def finish(self) -> OutputDelta:
        return OutputDelta()


class ScriptedHandle:
    """Stands in for a GenerationHandle: one event per delta, then the final one."""

    def __init__(self, n_deltas: int, finish_reason: str = "stop", completion_tokens: int = 10,
                 stop_sequence: str | None = None, prompt_tokens: int = 20):
        self._events = [GenerationEvent(text="x") for _ in range(n_deltas)]
        self._events.append(GenerationEvent(
            finish_reason=finish_reason, usage=Usage(prompt_tokens, completion_tokens), timings=Timings(),
            stop_sequence=stop_sequence, error="boom" if finish_reason == "error" else None,
        ))

    async def events(self):
        for event in self._events:
            yield event

    def cancel(self) -> None:
        pass


class ConnectedRequest:
    """Stands in for a starlette Request whose client never disconnects."""

    async def receive(self):
        await asyncio.Event().wait()


def collect_stream(agen) -> bytes:
    async def run():
        return b"".join([chunk async for chunk in agen])

    return asyncio.run(run())


def run_async(coro):
    return asyncio.run(coro)


def sse_frames(body: bytes) -> list[tuple[str | None, dict]]:
    """(event name, JSON data) of every frame."""
    out = []
    for frame in body.decode().split("\n\n"):
        if not frame:
            continue
        event, data = None, None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
        out.append((event, data))
    return out


def replaying_client(body: bytes, content_type: str = "text/event-stream") -> httpx2.Client:
    """An HTTP client (httpx2, as the official SDKs use) that answers every request with `body`."""
    return httpx2.Client(transport=httpx2.MockTransport(
        lambda request: httpx2.Response(200, content=body, headers={"content-type": content_type})
    ))


# Responses stream event type -> its schema in tests/data/openai-openapi.json.
RESPONSE_EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
}
