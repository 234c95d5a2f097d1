"""Anthropic Messages: a MessagesRequest becomes an OpenAI chat request (then the chat path's
GenerationRequest); ChatOutput deltas become content blocks, or SSE events in Anthropic's order.

Stream: message_start, ping, then per block content_block_start / content_block_delta... /
content_block_stop with indexes 0, 1, 2..., then message_delta (stop_reason, usage), message_stop.

A final assistant message is a prefill the answer continues (the chat request's `continue_final_message`);
`thinking.budget_tokens` becomes the engine's ThinkingBudget, which ends reasoning when it is used up.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from mlx_server.api.anthropic.protocol import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from mlx_server.api.chat_like import (
    ChatTranslation,
    Segments,
    Step,
    build_request,
    count_prompt_tokens,
    parse_arguments,
    tool_call,
)
from mlx_server.api.errors import APIError, anthropic_error_body
from mlx_server.api.openai.serving import ChatServing, run_to_end, submit
from mlx_server.api.sse import SSE_HEADERS, event_frame, on_disconnect
from mlx_server.engine.request import GenerationEvent, GenerationRequest
from mlx_server.engine.scheduler import GenerationHandle
from mlx_server.text.chat_output import ChatOutput, OutputDelta

# Chat request fields an error may name -> the Anthropic fields they were made from.
RENAMES = {"stop": "stop_sequences", "response_format.json_schema.schema": "output_config.format.schema",
           "response_format": "output_config.format", "reasoning_effort": "output_config.effort",
           "chat_template_kwargs": "thinking", "tool_choice.function.name": "tool_choice.name"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class MessagesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat

    # ---- request translation ----

    def translate(self, req: CountTokensRequest) -> tuple[ChatTranslation, dict]:
        """The chat messages and the chat request fields this request means."""
        out = ChatTranslation()
        if req.system:
            system = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
            out.add({"role": "system", "content": system}, "system")
        tool_names: dict[str, str] = {}
        for i, m in enumerate(req.messages):
            add_message(out, i, m, tool_names)
        fields: dict = {"model": req.model}
        if req.messages[-1].role == "assistant" and prefill(out, len(req.messages) - 1):
            fields["continue_final_message"] = True
        if req.tools:
            fields["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
                for t in req.tools
            ]
        if req.tool_choice:
            choice = req.tool_choice
            fields["tool_choice"] = TOOL_CHOICES.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if req.thinking:
            fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.output_config and req.output_config.format:
            schema = {"name": "output", "schema": req.output_config.format.json_schema, "strict": True}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        if req.output_config and req.output_config.effort:
            fields["reasoning_effort"] = {"max": "xhigh"}.get(req.output_config.effort, req.output_config.effort)
        return out, fields

    def build_request(self, req: MessagesRequest, request_id: str) -> GenerationRequest:
        translation, fields = self.translate(req)
        gen = build_request(
            self.chat, translation, RENAMES, request_id, **fields,
            max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k,
        )
        if req.thinking and req.thinking.type == "enabled":
            budget = self.chat.output.thinking_budget(req.thinking.budget_tokens, gen.output.starts_in_reasoning)
            gen.sampling.thinking_budget = budget
        return gen

    def count_tokens(self, req: CountTokensRequest) -> dict:
        translation, fields = self.translate(req)
        return {"input_tokens": count_prompt_tokens(self.chat, translation, RENAMES, **fields)}

    # ---- responses ----

    async def create(self, req: MessagesRequest, request: Request):
        message_id = "msg_" + secrets.token_hex(12)
        gen_request = await asyncio.to_thread(self.build_request, req, message_id)
        handle = submit(self.chat.engine, gen_request)
        head = {"id": message_id, "type": "message", "role": "assistant", "model": req.model}
        output = ChatOutput(gen_request.output)
        if req.stream:
            stream = self._stream(handle, output, head, len(gen_request.prompt_tokens), req.max_tokens, request)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        return await self._complete(handle, output, head, req.max_tokens, request)

    async def _complete(self, handle: GenerationHandle, output: ChatOutput, head: dict, max_tokens: int,
                        request: Request) -> JSONResponse:
        blocks = BlockStream()
        event = await run_to_end(handle, request, lambda e: blocks.feed(output.feed(e.text)))
        blocks.feed(output.finish())
        blocks.close()
        reason, sequence = stop_reason(event, blocks.used_tools, max_tokens)
        body = {**head, "content": blocks.content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(event)}
        return JSONResponse(body)

    async def _stream(self, handle: GenerationHandle, output: ChatOutput, head: dict, n_prompt: int, max_tokens: int,
                      request: Request):
        watcher = on_disconnect(request, handle.cancel)
        blocks = BlockStream()
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": n_prompt, "output_tokens": 0}}
        try:
            yield event_frame("message_start", {"type": "message_start", "message": start})
            yield event_frame("ping", {"type": "ping"})
            async for event in handle.events():
                if event.finish_reason == "error":
                    error = APIError(503, event.error or "generation failed", type="server_error")
                    yield event_frame("error", anthropic_error_body(error))
                    return
                events = blocks.feed(output.feed(event.text))
                if event.finish_reason is not None:
                    events += blocks.feed(output.finish()) + blocks.close()
                for name, payload in events:
                    yield event_frame(name, payload)
                if event.finish_reason is not None:
                    reason, sequence = stop_reason(event, blocks.used_tools, max_tokens)
                    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                             "usage": usage(event)}
                    yield event_frame("message_delta", delta)
                    yield event_frame("message_stop", {"type": "message_stop"})
        finally:
            watcher.cancel()
            handle.cancel()


def add_message(out: ChatTranslation, i: int, m: Message, tool_names: dict[str, str]) -> None:
    """One Anthropic message as chat messages: tool results become `tool` messages before the rest."""
    path = f"messages[{i}]"
    if isinstance(m.content, str):
        out.add({"role": m.role, "content": m.content}, path)
        return
    parts, sources, texts, thinking, calls = [], [], [], [], []
    for j, block in enumerate(m.content):
        where = f"{path}.content[{j}]"
        if isinstance(block, ToolResultBlock) and m.role == "user":
            content = tool_result_text(block, where)
            message = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
            if block.tool_use_id in tool_names:
                message["name"] = tool_names[block.tool_use_id]
            out.add(message, where)
        elif isinstance(block, ToolUseBlock) and m.role == "assistant":
            tool_names[block.id] = block.name
            calls.append(tool_call(block.id, block.name, block.input))
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)) and m.role == "assistant":
            if isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
        elif isinstance(block, TextBlock) and m.role == "assistant":
            texts.append(block.text)
        elif isinstance(block, (TextBlock, ImageBlock)) and m.role == "user":
            parts.append(chat_part(block))
            sources.append(j)
        elif isinstance(block, DocumentBlock):
            raise APIError(400, f"{where}: document blocks are not supported by this server; send the text", param=where)
        else:
            raise APIError(400, f"{where}: a {block.type} block cannot be in a {m.role} message", param=where)
    if m.role == "user" and parts:
        out.add({"role": "user", "content": parts}, path, sources)
    elif m.role == "assistant":
        message = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        out.add(message, path)


def prefill(out: ChatTranslation, i: int) -> bool:
    """A final assistant message (`messages[i]`, the last chat message) is text for the answer to continue,
    as Anthropic does: True when there is some; an empty one is dropped (an ordinary answer follows)."""
    message = out.messages[-1]
    if message.get("tool_calls"):
        raise APIError(400, f"messages[{i}]: a final assistant message is continued by the model and cannot contain "
                            "tool_use blocks; send their tool_result blocks in a user message", param=f"messages[{i}]")
    if not message["content"] and not message.get("reasoning_content"):
        out.messages.pop()
        out.origins.pop()
        return False
    if message["content"] != message["content"].rstrip():
        raise APIError(400, "messages: final assistant content cannot end with trailing whitespace", param=f"messages[{i}].content")
    return True


def chat_part(block: TextBlock | ImageBlock) -> dict:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def tool_result_text(block: ToolResultBlock, where: str) -> str:
    """A tool result as the text the template shows; an error result says so."""
    if isinstance(block.content, list):
        for k, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise APIError(400, f"{where}.content[{k}]: this model is text-only; tool results can only carry text",
                               param=f"{where}.content[{k}]")
        text = "\n".join(part.text for part in block.content)
    else:
        text = block.content or ""
    return f"Error: {text}" if block.is_error else text


class BlockStream:
    """ChatOutput deltas -> Anthropic content-block events; `content` accumulates the blocks."""

    def __init__(self):
        self.content: list[dict] = []
        self.used_tools = False
        self._segments = Segments()
        self._arguments = ""

    def feed(self, delta: OutputDelta) -> list[tuple[str, dict]]:
        return [self._event(step) for step in self._segments.feed(delta)]

    def close(self) -> list[tuple[str, dict]]:
        return [self._event(step) for step in self._segments.close()]

    def _event(self, step: Step) -> tuple[str, dict]:
        if step.op == "start":
            block = new_block(step)
            self.used_tools |= step.kind == "tool_call"
            self.content.append(dict(block))
            return "content_block_start", {"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}
        index = len(self.content) - 1
        if step.op == "end":
            if step.kind == "tool_call":
                self.content[-1]["input"] = parse_arguments(self._arguments)
                self._arguments = ""
            return "content_block_stop", {"type": "content_block_stop", "index": index}
        if step.kind == "tool_call":
            self._arguments += step.text
            delta = {"type": "input_json_delta", "partial_json": step.text}
        else:
            key = "text" if step.kind == "content" else "thinking"
            self.content[-1][key] += step.text
            delta = {"type": f"{key}_delta", key: step.text}
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def new_block(step: Step) -> dict:
    """A content block as content_block_start announces it (empty, to be filled by deltas)."""
    if step.kind == "content":
        return {"type": "text", "text": ""}
    if step.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    call = step.call
    return {"type": "tool_use", "id": call.id or "toolu_" + secrets.token_hex(12), "name": call.name or "", "input": {}}


def stop_reason(event: GenerationEvent, used_tools: bool, max_tokens: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the generation ended."""
    if event.finish_reason == "length":
        full = event.usage.completion_tokens >= max_tokens
        return ("max_tokens" if full else "model_context_window_exceeded"), None
    if used_tools:
        return "tool_use", None
    if event.stop_sequence is not None:
        return "stop_sequence", event.stop_sequence
    return "end_turn", None


def usage(event: GenerationEvent) -> dict:
    """Anthropic counts cached prompt tokens apart: input + cache_read is the whole prompt."""
    u = event.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }
