"""Shared by the protocols that translate into an OpenAI chat request (Anthropic Messages, Responses).

In: they build the chat request's messages here, recording where each came from in their
own request, so that the chat path (ChatServing.build_request: template, limits, context
budget and whatever else chat requests get) does the work, and its errors still name their
fields. Out: `Segments` cuts ChatOutput deltas into the blocks (Anthropic) or output items
(Responses) that both protocols stream as start / append... / end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pydantic import ValidationError

from mlx_server.api import limits
from mlx_server.api.errors import APIError, validation_error
from mlx_server.api.openai.protocol import ChatCompletionRequest
from mlx_server.api.openai.serving import ChatServing
from mlx_server.engine.request import GenerationRequest
from mlx_server.text.chat_output import OutputDelta, ToolCallDelta


@dataclass
class ChatTranslation:
    """OpenAI chat messages built from another protocol, each with the path it came from."""

    messages: list[dict] = field(default_factory=list)
    origins: list[tuple[str, list[int] | None]] = field(default_factory=list)

    def add(self, message: dict, path: str, parts: list[int] | None = None) -> None:
        """`parts[j]` is the source index of the message's content part j (None: same index)."""
        self.messages.append(message)
        self.origins.append((path, parts))

    def request(self, renames: dict[str, str], **fields) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest.model_validate({"messages": self.messages, **fields})
        except ValidationError as e:
            raise self.rename(validation_error([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]), renames)

    def rename(self, err: APIError, renames: dict[str, str]) -> APIError:
        """Rewrite the chat field an error names as ours: `messages[3].content[1]` by where that
        message came from, anything else by the longest matching prefix in `renames`."""
        old = err.param or ""
        match = re.match(r"messages\[(\d+)\](?:\.content\[(\d+)\])?", old)
        if match and int(match.group(1)) < len(self.origins):
            path, parts = self.origins[int(match.group(1))]
            if match.group(2) is not None:
                j = int(match.group(2))
                path += f".content[{parts[j] if parts and j < len(parts) else j}]"
            new = path + old[match.end():]
        else:
            prefixes = [k for k in renames if old == k or old.startswith((k + ".", k + "["))]
            key = max(prefixes, key=len, default="")
            new = renames[key] + old[len(key):] if key else old
        if new != old:
            err.message = err.message.replace(old, new, 1)
            err.param = new
        return err


def build_request(chat: ChatServing, translation: ChatTranslation, renames: dict[str, str], request_id: str,
                  **fields) -> GenerationRequest:
    """The GenerationRequest for a translated request; errors name the caller's own fields."""
    req = translation.request(renames, **fields)
    try:
        return chat.build_request(req, request_id)
    except APIError as e:
        raise translation.rename(e, renames)


def count_prompt_tokens(chat: ChatServing, translation: ChatTranslation, renames: dict[str, str], **fields) -> int:
    """How many tokens the rendered prompt is, without the context-window check."""
    req = translation.request(renames, **fields)
    try:
        return len(prompt_tokens(chat, req))
    except APIError as e:
        raise translation.rename(e, renames)


def prompt_tokens(chat: ChatServing, req: ChatCompletionRequest) -> list[int]:
    """A chat request's prompt tokens, as build_request renders them, without the context-window check."""
    limits.check_chat_request(req)
    messages = [chat.template_message(i, m) for i, m in enumerate(req.messages)]
    return chat.encode_messages(messages, req)[1]


def tool_call(call_id: str, name: str, arguments) -> dict:
    """An OpenAI `tool_calls` entry, as chat requests carry earlier calls."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_arguments(text: str) -> dict:
    """A tool call's generated arguments as an object; text that is not one is kept, not lost."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_raw": text}


@dataclass
class Step:
    op: str  # "start", "append" or "end" of a segment
    kind: str  # "reasoning", "content" or "tool_call"
    text: str = ""  # on "append": the next text (for a tool call, of its JSON arguments)
    call: ToolCallDelta | None = None  # on a tool call's "start": its index, id and name


class Segments:
    """ChatOutput deltas -> start/append/end steps, one segment per thinking block, text or tool call.

    Reasoning or content opens a segment at its first non-blank text, so the whitespace a
    model writes between its reasoning and a tool call never becomes a block of its own.
    """

    def __init__(self):
        self._open: tuple[str, int] | None = None  # (kind, tool call index) of the open segment
        self._held_kind: str | None = None
        self._held = ""  # blank text waiting to see whether its segment ever gets content

    def feed(self, delta: OutputDelta) -> list[Step]:
        steps = []
        if delta.reasoning:
            steps += self._text("reasoning", delta.reasoning)
        if delta.content:
            steps += self._text("content", delta.content)
        for call in delta.tool_calls:
            if self._open != ("tool_call", call.index):
                steps += self.close()
                self._open = ("tool_call", call.index)
                steps.append(Step("start", "tool_call", call=call))
            if call.arguments:
                steps.append(Step("append", "tool_call", call.arguments))
        return steps

    def close(self) -> list[Step]:
        """End the open segment (at a switch, and once at the end of the output)."""
        open_, self._open, self._held_kind, self._held = self._open, None, None, ""
        return [Step("end", open_[0])] if open_ else []

    def _text(self, kind: str, text: str) -> list[Step]:
        if self._open == (kind, 0):
            return [Step("append", kind, text)]
        steps = self.close() if self._open else []
        if self._held_kind != kind:
            self._held_kind, self._held = kind, ""
        self._held += text
        if not self._held.strip():
            return steps
        text, self._held_kind, self._held = self._held, None, ""
        self._open = (kind, 0)
        return steps + [Step("start", kind), Step("append", kind, text)]
