"""OpenAI Responses: a ResponsesRequest (with the stored conversation it continues) becomes an
OpenAI chat request, then the chat path's GenerationRequest; ChatOutput deltas become output
items (reasoning, message, function_call), or `response.*` SSE events in OpenAI's order.

Stream: response.created, response.in_progress, then per item output_item.added,
[content_part.added], deltas, [*.done, content_part.done], output_item.done, and last
response.completed (or response.incomplete at max_output_tokens, response.failed on an error).
"""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from mlx_server.api.chat_like import ChatTranslation, Segments, Step, build_request, tool_call
from mlx_server.api.errors import APIError
from mlx_server.api.openai.serving import ChatServing, run_to_end, submit
from mlx_server.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    ItemReference,
    MessageItem,
    Refusal,
    ResponsesRequest,
)
from mlx_server.api.responses.store import ResponseStore, StoredResponse
from mlx_server.api.sse import SSE_HEADERS, event_frame, on_disconnect
from mlx_server.engine.request import GenerationEvent, SamplingParams
from mlx_server.engine.scheduler import GenerationHandle
from mlx_server.text.chat_output import ChatOutput, OutputDelta

# Chat request fields an error may name -> the Responses fields they were made from.
RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format.json_schema.schema": "text.format.schema",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort",
           "tool_choice.function.name": "tool_choice.name"}


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store or ResponseStore()

    # ---- request translation ----

    def translate(self, req: ResponsesRequest) -> tuple[ChatTranslation, dict]:
        """The chat messages and fields this request means (instructions, then the stored conversation)."""
        out = ChatTranslation()
        if req.instructions:
            out.add({"role": "system", "content": req.instructions}, "instructions")
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, f"previous_response_id: no stored response with id '{req.previous_response_id}' "
                               "(responses are kept in memory, a bounded number, until the server restarts)",
                               param="previous_response_id", code="previous_response_not_found")
            for message in previous.history:
                out.add(message, "previous_response_id")
        items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
        add_items(out, items)
        fields: dict = {"model": req.model}
        if req.tools:
            fields["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.parameters or {"type": "object", "properties": {}}}}
                for t in req.tools
            ]
        if isinstance(req.tool_choice, str):
            fields["tool_choice"] = req.tool_choice
        elif req.tool_choice is not None:
            fields["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        if req.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = req.parallel_tool_calls
        fmt = req.text.format if req.text else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": bool(fmt.strict)}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        if req.reasoning and req.reasoning.effort:
            fields["reasoning_effort"] = req.reasoning.effort
        return out, fields

    # ---- responses ----

    async def create(self, req: ResponsesRequest, request: Request):
        response_id = "resp_" + secrets.token_hex(24)
        translation, fields = self.translate(req)
        gen_request = await asyncio.to_thread(
            build_request, self.chat, translation, RENAMES, response_id, **fields, max_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        )
        handle = submit(self.chat.engine, gen_request)
        head = response_head(response_id, req, gen_request.sampling)
        # Instructions are not carried over to the responses that continue this one.
        history = tuple(translation.messages[1:] if req.instructions else translation.messages)
        output = ChatOutput(gen_request.output)
        if req.stream:
            stream = self._stream(handle, output, head, history, req.store is not False, request)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        return await self._complete(handle, output, head, history, req.store is not False, request)

    async def _complete(self, handle: GenerationHandle, output: ChatOutput, head: dict, history: tuple, store: bool,
                        request: Request) -> JSONResponse:
        items = ItemStream()
        event = await run_to_end(handle, request, lambda e: items.feed(output.feed(e.text)))
        items.feed(output.finish())
        items.close(item_status(event))
        response = self._finished(head, items, event, history, store)
        return JSONResponse(response)

    async def _stream(self, handle: GenerationHandle, output: ChatOutput, head: dict, history: tuple, store: bool,
                      request: Request):
        watcher = on_disconnect(request, handle.cancel)
        items = ItemStream()
        sequence = 0

        def frame(event: dict) -> bytes:
            nonlocal sequence
            sequence += 1
            return event_frame(event["type"], {**event, "sequence_number": sequence - 1})

        try:
            pending = {**head, "status": "in_progress", "output": []}
            yield frame({"type": "response.created", "response": pending})
            yield frame({"type": "response.in_progress", "response": pending})
            async for event in handle.events():
                if event.finish_reason == "error":
                    error = {"code": "server_error", "message": event.error or "generation failed"}
                    failed = {**head, "status": "failed", "error": error, "output": items.output}
                    yield frame({"type": "response.failed", "response": failed})
                    return
                events = items.feed(output.feed(event.text))
                if event.finish_reason is not None:
                    events += items.feed(output.finish()) + items.close(item_status(event))
                for e in events:
                    yield frame(e)
                if event.finish_reason is not None:
                    response = self._finished(head, items, event, history, store)
                    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                    yield frame({"type": kind, "response": response})
        finally:
            watcher.cancel()
            handle.cancel()

    def _finished(self, head: dict, items: "ItemStream", event: GenerationEvent, history: tuple, store: bool) -> dict:
        """The final Response object; stored (with the conversation it ends) unless store is false."""
        incomplete = event.finish_reason == "length"
        response = {
            **head,
            "status": "incomplete" if incomplete else "completed",
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items.output,
            "usage": self._usage(event, items.reasoning_text),
        }
        if store:
            self.store.put(head["id"], StoredResponse(response, history + (items.as_chat_message(),)))
        return response

    def _usage(self, event: GenerationEvent, reasoning: str) -> dict:
        u = event.usage
        reasoning_tokens = len(self.chat.prompt.encode(reasoning)) if reasoning else 0
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id '{response_id}'", param="response_id", code="not_found")


def add_items(out: ChatTranslation, items: list) -> None:
    """Input items as chat messages: function calls join the assistant turn they follow.

    Reasoning items are not shown to the model again (chat templates drop earlier reasoning too).
    """
    for k, item in enumerate(items):
        path = f"input[{k}]"
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else [chat_part(p, f"{path}.content[{j}]")
                                                                           for j, p in enumerate(item.content)]
            out.add({"role": item.role, "content": content}, path)
        elif isinstance(item, FunctionCallItem):
            call = tool_call(item.call_id, item.name, item.arguments)
            last = out.messages[-1] if out.messages else None
            if last is not None and last["role"] == "assistant" and out.origins[-1][0].startswith("input["):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.add({"role": "assistant", "content": None, "tool_calls": [call]}, path)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": output_text(item, path)}
            names = [c["function"]["name"] for m in out.messages for c in m.get("tool_calls") or [] if c["id"] == item.call_id]
            if names:
                message["name"] = names[-1]
            out.add(message, path)
        elif isinstance(item, ItemReference):
            raise APIError(400, f"{path}: item_reference is not supported; send the item itself, or use previous_response_id",
                           param=path)


def chat_part(part, where: str) -> dict:
    if isinstance(part, InputText):
        return {"type": "text", "text": part.text}
    if isinstance(part, Refusal):
        return {"type": "refusal", "refusal": part.refusal}
    if isinstance(part, InputImage):
        if part.image_url is None:
            raise APIError(400, f"{where}: file_id images are not supported; send image_url", param=where)
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "file", "file": part.model_extra or {}}


def output_text(item: FunctionCallOutputItem, path: str) -> str:
    if isinstance(item.output, str):
        return item.output
    texts = []
    for j, part in enumerate(item.output):
        if not isinstance(part, InputText):
            raise APIError(400, f"{path}.output[{j}]: this model is text-only; function outputs can only carry text",
                           param=f"{path}.output[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def response_head(response_id: str, req: ResponsesRequest, sampling: SamplingParams) -> dict:
    """The Response fields that echo the request (everything but status, output and usage)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice or "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,
        "model": req.model,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "tools": [
            {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
            for t in req.tools or []
        ],
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt},
        "reasoning": {"effort": req.reasoning.effort, "summary": None} if req.reasoning else None,
        "store": req.store is not False,
        "truncation": "disabled",
        "metadata": req.metadata or {},
    }


def item_status(event: GenerationEvent) -> str:
    return "incomplete" if event.finish_reason == "length" else "completed"


class ItemStream:
    """ChatOutput deltas -> Responses output-item events (no sequence numbers); `output` holds the items."""

    def __init__(self):
        self.output: list[dict] = []
        self._segments = Segments()
        self._text = ""  # the open item's text or arguments so far

    def feed(self, delta: OutputDelta) -> list[dict]:
        return [e for step in self._segments.feed(delta) for e in self._events(step, "completed")]

    def close(self, status: str = "completed") -> list[dict]:
        """End the output; the last item gets `status` (incomplete when max_output_tokens cut it)."""
        return [e for step in self._segments.close() for e in self._events(step, status)]

    @property
    def reasoning_text(self) -> str:
        return "".join(c["text"] for item in self.output if item["type"] == "reasoning" for c in item["content"])

    def as_chat_message(self) -> dict:
        """The output as the assistant turn a later request's conversation continues from."""
        text = "".join(c["text"] for item in self.output if item["type"] == "message" for c in item["content"])
        message = {"role": "assistant", "content": text}
        if self.reasoning_text:
            message["reasoning_content"] = self.reasoning_text
        calls = [tool_call(i["call_id"], i["name"], i["arguments"]) for i in self.output if i["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return message

    def _events(self, step: Step, status: str) -> list[dict]:
        index = len(self.output) - 1 if step.op != "start" else len(self.output)
        where = {"output_index": index}
        if step.op == "start":
            self._text = ""
            item = new_item(step)
            self.output.append(item)
            events = [{"type": "response.output_item.added", **where, "item": dict(item)}]
            if step.kind != "tool_call":
                part = new_part(step.kind, "")
                events.append({"type": "response.content_part.added", "item_id": item["id"], **where, "content_index": 0, "part": part})
            return events
        item = self.output[-1]
        where["item_id"] = item["id"]
        if step.op == "append":
            self._text += step.text
            if step.kind == "tool_call":
                return [{"type": "response.function_call_arguments.delta", **where, "delta": step.text}]
            if step.kind == "reasoning":
                return [{"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": step.text}]
            return [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": step.text, "logprobs": []}]
        item["status"] = status
        if step.kind == "tool_call":
            item["arguments"] = self._text
            done = {"type": "response.function_call_arguments.done", **where, "name": item["name"], "arguments": self._text}
            return [done, {"type": "response.output_item.done", "output_index": index, "item": item}]
        part = new_part(step.kind, self._text)
        item["content"] = [part]
        if step.kind == "reasoning":
            done = {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": self._text}
        else:
            done = {"type": "response.output_text.done", **where, "content_index": 0, "text": self._text, "logprobs": []}
        return [
            done,
            {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]


def new_item(step: Step) -> dict:
    """An output item as output_item.added announces it (empty, to be filled by deltas)."""
    if step.kind == "reasoning":
        return {"id": "rs_" + secrets.token_hex(24), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
    if step.kind == "content":
        return {"id": "msg_" + secrets.token_hex(24), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
    call = step.call
    return {"id": "fc_" + secrets.token_hex(24), "type": "function_call", "call_id": call.id or "call_" + secrets.token_hex(12),
            "name": call.name or "", "arguments": "", "status": "in_progress"}


def new_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
