"""OpenAI chat: a ChatCompletionRequest becomes a GenerationRequest; engine events become
`chat.completion` objects or `chat.completion.chunk` SSE frames."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from mlx_server.api import images, limits
from mlx_server.api.errors import APIError
from mlx_server.api.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, TextPart, RefusalPart
from mlx_server.api.output import OutputPlanner, OutputRequest
from mlx_server.api.prompt import ChatPrompt
from mlx_server.api.sse import DONE, SSE_HEADERS, data_frame, on_disconnect
from mlx_server.config import Settings
from mlx_server.engine.request import GenerationEvent, GenerationRequest, SamplingParams, TokenLogprob
from mlx_server.engine.scheduler import Engine, EngineBusy, EngineUnavailable, GenerationHandle, KVCapExceeded
from mlx_server.engine.vision import VisionInput
from mlx_server.media import MediaPolicy
from mlx_server.text.chat_output import ChatOutput, OutputDelta, ToolCallDelta

ROLE_ALIASES = {"developer": "system", "function": "tool"}


class ChatServing:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.prompt = ChatPrompt(engine.tokenizer, settings)
        self.output = OutputPlanner(engine.tokenizer, settings, self.prompt.template_source)
        self.reasoning_key = "reasoning" if settings.reasoning_format == "reasoning" else "reasoning_content"
        self.vision = engine.vision  # engine/vision.py's Vision when the model takes images
        self.media_policy = MediaPolicy(allow_remote=settings.remote_media, max_bytes=settings.max_media_bytes)

    # ---- request translation ----

    def build_request(self, req: ChatCompletionRequest, request_id: str) -> GenerationRequest:
        """Render the prompt and check every limit; raises APIError naming the field at fault."""
        limits.check_chat_request(req)
        messages = [self.template_message(i, m) for i, m in enumerate(req.messages)]
        want = self.output_request(req)
        continued = self.continues_final_message(req)
        if continued:
            want.prefill = message_text(messages[-1])
        text, tokens, vision = self.encode_messages(messages, req)
        requested = req.max_completion_tokens or req.max_tokens
        if requested is None and req.n_predict is not None and req.n_predict > 0:
            requested = req.n_predict
        plan = self.output.plan(text, want)
        sampling = self.sampling_params(req)
        sampling.logit_bias.update({token: float("-inf") for token in plan.banned_tokens})
        return GenerationRequest(
            id=request_id,
            prompt_tokens=tokens,
            max_tokens=self.prompt.completion_budget(len(tokens), requested),
            sampling=sampling,
            stop=self.prompt.stop_strings(req.stop),
            grammar=plan.grammar,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            output=plan.config,
            continues_text=continued,
            vision=vision,
        )

    def output_request(self, req: ChatCompletionRequest) -> OutputRequest:
        """tools, tool_choice, parallel_tool_calls and response_format, checked; 400s name the field."""
        tools = req.tools or []
        for i, tool in enumerate(tools):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise APIError(400, f"tools[{i}]: only function tools are supported ({{\"type\": \"function\", \"function\": {{...}}}})", param=f"tools[{i}]")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise APIError(400, f"tools[{i}].function.name: a function needs a name", param=f"tools[{i}].function.name")
            if not isinstance(fn.get("parameters", {}), (dict, type(None))):
                raise APIError(400, f"tools[{i}].function.parameters: must be a JSON Schema object", param=f"tools[{i}].function.parameters")
        choice, name = req.tool_choice or "auto", None
        if isinstance(choice, NamedToolChoice):
            choice, name = "function", choice.function.name
            if name not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice.function.name: no function named '{name}' in tools", param="tool_choice.function.name")
        elif choice == "required" and not tools:
            raise APIError(400, "tool_choice: 'required' needs at least one tool in tools", param="tool_choice")
        schema = None
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            schema = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format.json_schema: required when type is 'json_schema'", param="response_format.json_schema")
            schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        return OutputRequest(
            tools=tools,
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            json_schema=schema,
            schema_param="response_format.json_schema.schema" if fmt is not None and fmt.type == "json_schema" else "response_format",
        )

    @staticmethod
    def continues_final_message(req: ChatCompletionRequest) -> bool:
        """vLLM's `continue_final_message`: the output continues the last message, an assistant's (a prefill)."""
        if not req.continue_final_message:
            return False
        if req.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message: the last message must be the assistant's, to be continued", param="continue_final_message")
        if req.add_generation_prompt:
            raise APIError(400, "add_generation_prompt: cannot be true with continue_final_message (the prompt ends inside the "
                                "last message, not after a new assistant header)", param="add_generation_prompt")
        return True

    @staticmethod
    def template_kwargs(req: ChatCompletionRequest) -> dict | None:
        """chat_template_kwargs, with reasoning_effort (gpt-oss templates read it) unless they set it."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        return kwargs or None

    def template_message(self, i: int, m: ChatMessage) -> dict:
        """One message as chat templates expect it; media on a text-only model is a 400.

        For a vision model the content is a list of parts, images and videos as api/images.py makes them."""
        if self.vision is None:
            for field in ("images", "videos"):
                if getattr(m, field):
                    raise APIError(400, f"messages[{i}].{field}: this model is text-only and does not accept {field}", param=f"messages[{i}].{field}")
        parts = images.array_parts(m, i) if self.vision is not None else []
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                media = images.media_part(part, f"messages[{i}].content[{j}]") if self.vision is not None else None
                if isinstance(part, TextPart):
                    texts.append(part.text)
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, RefusalPart):
                    texts.append(part.refusal)
                    parts.append({"type": "text", "text": part.refusal})
                elif media is not None:
                    parts.append(media)
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
        if m.reasoning_content:
            out["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            out = self.prompt.assistant_tool_calls(out, [template_tool_call(c.model_dump(exclude_none=True)) for c in m.tool_calls])
        if self.vision is not None:
            out["content"] = images.template_content(parts, out["content"], interleaved=not m.tool_calls)
        return out

    def encode_messages(self, messages: list[dict], req: ChatCompletionRequest) -> tuple[str, list[int], VisionInput | None]:
        """The rendered prompt and its tokens; a vision model's images are loaded and processed here."""
        loaded = images.load_media(messages, self.media_policy) if self.vision is not None else []
        text = self.prompt.render(messages, req.tools, self.template_kwargs(req), self.continues_final_message(req),
                                  req.add_generation_prompt is not False)
        if not loaded:
            return text, self.prompt.encode(text), None
        try:
            vision = self.vision.prepare(text, loaded)
        except Exception as e:  # the processor's complaints are about this request's images and prompt
            raise APIError(400, f"messages: the model's processor rejected these images: {e}", param="messages", code="invalid_media")
        return text, vision.tokens, vision

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
        output = ChatOutput(gen_request.output)
        if req.stream:
            return StreamingResponse(
                self._stream(handle, output, meta, request), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await self._complete(handle, output, meta, request)

    async def _complete(self, handle: GenerationHandle, output: ChatOutput, meta: dict, request: Request) -> JSONResponse:
        parts: list[OutputDelta] = []
        logprobs: list[TokenLogprob] | None = None

        def on_event(event: GenerationEvent) -> None:
            nonlocal logprobs
            parts.append(output.feed(event.text))
            if event.logprobs is not None:
                logprobs = (logprobs or []) + event.logprobs

        event = await run_to_end(handle, request, on_event)
        parts.append(output.finish())
        message = {"role": "assistant", "content": "".join(p.content for p in parts), "refusal": None}
        reasoning = "".join(p.reasoning for p in parts)
        if reasoning:
            message[self.reasoning_key] = reasoning
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
                    "logprobs": logprobs_dict(logprobs),
                    "finish_reason": finish_reason(event, len(calls)),
                }
            ],
            "usage": usage_dict(event),
            "timings": event.timings.as_dict(),
        }
        return JSONResponse(body)

    async def _stream(self, handle: GenerationHandle, output: ChatOutput, meta: dict, request: Request):
        watcher = on_disconnect(request, handle.cancel)
        base = {**meta, "object": "chat.completion.chunk"}
        pending: list[TokenLogprob] | None = None  # logprobs of tokens whose text is still held back

        def chunk(delta: dict, finish_reason=None, **extra) -> bytes:
            nonlocal pending
            choice = {"index": 0, "delta": delta, "logprobs": logprobs_dict(pending), "finish_reason": finish_reason}
            pending = None
            return data_frame({**base, "choices": [choice], **extra})

        try:
            yield chunk({"role": "assistant"})
            async for event in handle.events():
                if event.finish_reason == "error":
                    error = {"message": event.error, "type": "server_error", "param": None, "code": "generation_failed"}
                    yield b"error: " + json.dumps({"message": event.error}).encode() + b"\n\n"
                    yield data_frame({"error": error})
                    return
                if event.logprobs is not None:
                    pending = (pending or []) + event.logprobs
                delta = output.feed(event.text)
                if event.finish_reason is not None:
                    delta = delta + output.finish()
                if delta:
                    yield chunk(delta_dict(delta, self.reasoning_key))
                if event.finish_reason is not None:
                    reason = finish_reason(event, output.tool_calls_seen)
                    yield chunk({}, reason, usage=usage_dict(event), timings=event.timings.as_dict())
            yield DONE
        finally:
            watcher.cancel()
            handle.cancel()


def message_text(message: dict) -> str:
    """A template message's text (a vision model's content is a list of parts)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def delta_dict(delta: OutputDelta, reasoning_key: str = "reasoning_content") -> dict:
    """An OutputDelta as an OpenAI `delta` object (only the keys that have something)."""
    out = {}
    if delta.reasoning:
        out[reasoning_key] = delta.reasoning
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


def finish_reason(event: GenerationEvent, n_calls: int) -> str:
    """`tool_calls` when the model called tools and stopped by itself; a cut-off answer stays `length`."""
    return "tool_calls" if n_calls and event.finish_reason == "stop" else event.finish_reason


def template_tool_call(call: dict) -> dict:
    """A tool call as chat templates expect it: arguments as an object when they are one (OpenAI sends JSON text)."""
    arguments = call.get("function", {}).get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def logprobs_dict(entries: list[TokenLogprob] | None) -> dict | None:
    """OpenAI's `choice.logprobs`; -9999.0 stands for a probability too small to write (OpenAI's convention)."""
    if entries is None:
        return None

    def one(token: bytes, logprob: float) -> dict:
        return {"token": token.decode("utf-8", "replace"), "logprob": max(logprob, -9999.0), "bytes": list(token)}

    content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


async def run_to_end(handle: GenerationHandle, request: Request, on_event) -> GenerationEvent:
    """A non-streamed answer: every event to `on_event`, the client's disconnect cancelling it;
    returns the last event; a failed generation is a 503."""
    watcher = on_disconnect(request, handle.cancel)
    try:
        async for event in handle.events():
            on_event(event)
    finally:
        watcher.cancel()
    if event.finish_reason == "error":
        raise APIError(503, event.error or "generation failed", type="server_error", code="generation_failed")
    return event


def submit(engine: Engine, request: GenerationRequest) -> GenerationHandle:
    """Hand a request to the engine; a full queue is a 429 rather than unbounded growth."""
    try:
        return engine.submit(request)
    except EngineBusy as e:
        raise APIError(429, f"{e}; retry shortly", type="rate_limit_error", code="server_busy")
    except EngineUnavailable as e:
        raise APIError(503, str(e), type="server_error", code="engine_unavailable")
    except KVCapExceeded as e:
        # A 400, not a 5xx: SDKs retry 5xx, and this prompt will never fit.
        raise APIError(400, str(e), param="messages", code="context_length_exceeded")


def usage_dict(event: GenerationEvent) -> dict:
    u = event.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
