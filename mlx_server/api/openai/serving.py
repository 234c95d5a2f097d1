"""OpenAI chat: a ChatCompletionRequest becomes a GenerationRequest; engine events become
`chat.completion` objects or `chat.completion.chunk` SSE frames."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from mlx_server.api.errors import APIError
from mlx_server.api.openai.protocol import ChatCompletionRequest, ChatMessage, TextPart, RefusalPart
from mlx_server.api.prompt import ChatPrompt
from mlx_server.api.sse import DONE, SSE_HEADERS, data_frame, on_disconnect
from mlx_server.config import Settings
from mlx_server.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from mlx_server.engine.scheduler import Engine, EngineBusy, GenerationHandle
from mlx_server.text.chat_output import ChatOutput, OutputDelta, ToolCallDelta

ROLE_ALIASES = {"developer": "system", "function": "tool"}


class ChatServing:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.prompt = ChatPrompt(engine.tokenizer, settings)

    # ---- request translation ----

    def build_request(self, req: ChatCompletionRequest, request_id: str) -> GenerationRequest:
        """Render the prompt and check every limit; raises APIError naming the field at fault."""
        messages = [self.template_message(i, m) for i, m in enumerate(req.messages)]
        text = self.prompt.render(messages, getattr(req, "tools", None), req.chat_template_kwargs)
        tokens = self.prompt.encode(text)
        requested = req.max_completion_tokens or req.max_tokens
        if requested is None and req.n_predict is not None and req.n_predict > 0:
            requested = req.n_predict
        return GenerationRequest(
            id=request_id,
            prompt_tokens=tokens,
            max_tokens=self.prompt.completion_budget(len(tokens), requested),
            sampling=self.sampling_params(req),
            stop=self.prompt.stop_strings(req.stop),
        )

    def template_message(self, i: int, m: ChatMessage) -> dict:
        """One message as chat templates expect it; media on a text-only model is a 400."""
        for field in ("images", "videos"):
            if getattr(m, field):
                raise APIError(400, f"messages[{i}].{field}: this model does not accept {field}", param=f"messages[{i}].{field}")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if isinstance(part, TextPart):
                    texts.append(part.text)
                elif isinstance(part, RefusalPart):
                    texts.append(part.refusal)
                else:
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}]: this model is text-only and does not accept '{part.type}' parts",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = "\n".join(texts)
        else:
            content = m.content or ""
        out = {"role": ROLE_ALIASES.get(m.role, m.role), "content": content}
        if m.name is not None:
            out["name"] = m.name
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            out = self.prompt.assistant_tool_calls(out, [c.model_dump(exclude_none=True) for c in m.tool_calls])
        return out

    def sampling_params(self, req: ChatCompletionRequest) -> SamplingParams:
        bias = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.prompt.vocab_size:
                raise APIError(400, f"logit_bias: '{key}' is not a token id of this model (0..{self.prompt.vocab_size - 1})", param="logit_bias")
            bias[int(key)] = value
        window = req.repeat_last_n
        if window is None:
            window = 64
        elif window == -1:
            window = self.settings.ctx_size
        penalty = req.repetition_penalty or req.repeat_penalty or 1.0
        return SamplingParams(
            temperature=0.7 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=penalty if window else 1.0,
            repetition_context_size=max(window, 1),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=req.seed,
        )

    # ---- responses ----

    async def create(self, req: ChatCompletionRequest, request: Request):
        request_id = "chatcmpl-" + secrets.token_hex(12)
        gen_request = await asyncio.to_thread(self.build_request, req, request_id)
        handle = submit(self.engine, gen_request)
        meta = {"id": request_id, "created": int(time.time()), "model": req.model}
        if req.stream:
            return StreamingResponse(
                self._stream(handle, meta, request), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await self._complete(handle, meta, request)

    async def _complete(self, handle: GenerationHandle, meta: dict, request: Request) -> JSONResponse:
        watcher = on_disconnect(request, handle.cancel)
        output = ChatOutput()
        parts: list[OutputDelta] = []
        try:
            async for event in handle.events():
                parts.append(output.feed(event.text))
        finally:
            watcher.cancel()
        if event.finish_reason == "error":
            raise APIError(503, event.error or "generation failed", type="server_error", code="generation_failed")
        parts.append(output.finish())
        message = {"role": "assistant", "content": "".join(p.content for p in parts), "refusal": None}
        reasoning = "".join(p.reasoning for p in parts)
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = merge_tool_calls(d for p in parts for d in p.tool_calls)
        if calls:
            message["tool_calls"] = calls
        body = {
            **meta,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if calls else event.finish_reason,
                }
            ],
            "usage": usage_dict(event),
            "timings": event.timings.as_dict(),
        }
        return JSONResponse(body)

    async def _stream(self, handle: GenerationHandle, meta: dict, request: Request):
        watcher = on_disconnect(request, handle.cancel)
        base = {**meta, "object": "chat.completion.chunk"}
        output = ChatOutput()

        def chunk(delta: dict, finish_reason=None, **extra) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return data_frame({**base, "choices": [choice], **extra})

        try:
            yield chunk({"role": "assistant"})
            async for event in handle.events():
                if event.finish_reason == "error":
                    error = {"message": event.error, "type": "server_error", "param": None, "code": "generation_failed"}
                    yield b"error: " + json.dumps({"message": event.error}).encode() + b"\n\n"
                    yield data_frame({"error": error})
                    return
                delta = output.feed(event.text)
                if event.finish_reason is not None:
                    tail = output.finish()
                    delta = OutputDelta(delta.content + tail.content, delta.reasoning + tail.reasoning, delta.tool_calls + tail.tool_calls)
                if delta:
                    yield chunk(delta_dict(delta))
                if event.finish_reason is not None:
                    reason = "tool_calls" if output.tool_calls_seen else event.finish_reason
                    yield chunk({}, reason, usage=usage_dict(event), timings=event.timings.as_dict())
            yield DONE
        finally:
            watcher.cancel()
            handle.cancel()


def delta_dict(delta: OutputDelta) -> dict:
    """An OutputDelta as an OpenAI `delta` object (only the keys that have something)."""
    out = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [tool_call_delta_dict(d) for d in delta.tool_calls]
    return out


def tool_call_delta_dict(d: ToolCallDelta) -> dict:
    out = {"index": d.index}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    function = {}
    if d.name is not None:
        function["name"] = d.name
    if d.arguments or d.name is not None:
        function["arguments"] = d.arguments
    out["function"] = function
    return out


def merge_tool_calls(deltas) -> list[dict]:
    """Streamed tool-call deltas -> complete `message.tool_calls` entries, in index order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if d.id is not None:
            call["id"] = d.id
        if d.name is not None:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def submit(engine: Engine, request: GenerationRequest) -> GenerationHandle:
    """Hand a request to the engine; a full queue is a 429 rather than unbounded growth."""
    try:
        return engine.submit(request)
    except EngineBusy as e:
        raise APIError(429, f"{e}; retry shortly", type="rate_limit_error", code="server_busy")


def usage_dict(event: GenerationEvent) -> dict:
    u = event.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
