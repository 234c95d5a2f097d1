"""Tool calls out of generated text, in any of mlx-lm's formats (feed/finish).

A format is one of mlx-lm's `tool_parsers` modules: `tool_call_start`, `tool_call_end` and
`parse_tool_call(text, tools)`. Text outside the markers is content; a marked segment becomes
one or more calls. For JSON calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen, Hermes) the arguments stream as they are generated; other formats are parsed when
their segment closes.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import secrets
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import regex
from mlx_lm import tool_parsers
from mlx_lm.tokenizer_utils import _infer_tool_parser

from mlx_server.text.reasoning import partial_suffix

# `{"name": "<name>", "arguments": ` with the arguments' value next.
_JSON_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str  # "" (Mistral): the segment runs to the end of the output
    parse: Callable[[str, Any], dict | list[dict]]

    @property
    def streams_arguments(self) -> bool:
        return self.name == "json_tools"


def tool_format_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(tool_parsers.__path__))


def tool_format(name: str) -> ToolFormat:
    """mlx-lm's tool parser module `name` as a ToolFormat; ValueError for an unknown name."""
    if name not in tool_format_names():
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(tool_format_names())}")
    m = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, m.tool_call_start, m.tool_call_end, m.parse_tool_call)


def infer_tool_format(tokenizer, chat_template: str | None) -> str | None:
    """The format a model writes, from its tokenizer config or else its chat template and vocabulary."""
    explicit = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
    if explicit:
        return explicit
    return _infer_tool_parser(SimpleNamespace(chat_template=chat_template, get_vocab=tokenizer.get_vocab))


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int  # 0, 1, 2... in the order the calls were generated
    id: str | None = None  # set on a call's first delta
    name: str | None = None  # set on a call's first delta
    arguments: str = ""  # the next fragment of the call's JSON arguments text


class ToolCallParser:
    """Feed content text; get back `(content, deltas)`: the content and the calls' ToolCallDeltas.

    Whitespace between content and calls is dropped once a call has been seen, so
    `"text\\n\\n<tool_call>..."` gives content `"text"`.
    """

    def __init__(self, fmt: ToolFormat, tools: list | None = None):
        self.fmt = fmt
        self.tools = tools
        self.calls = 0
        self._held = ""  # content: a possible partial start marker
        self._space = ""  # content: trailing whitespace, dropped if a call follows
        self._segment: str | None = None  # inside a call segment: its text so far
        self._json: _JsonCall | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        buf = text
        while buf:
            if self._segment is None:
                buf = self._content(buf, content)
            else:
                buf = self._in_segment(buf, deltas, content)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._segment is not None:
            self._close(self._segment, deltas, content, complete=False)
        held, self._held = self._held, ""
        tail = self._space + held
        self._space = ""
        if held or not self.calls:
            content.append(tail)
        return "".join(content), deltas

    # ---- content between calls ----

    def _content(self, text: str, content: list[str]) -> str:
        """Consume content up to a start marker; returns what follows the marker ("" if none)."""
        start = self.fmt.start
        buf, self._held = self._held + text, ""
        i = buf.find(start)
        if i < 0:
            keep = partial_suffix(buf, start)
            self._emit_content(buf[: len(buf) - keep], content)
            self._held = buf[len(buf) - keep :]
            return ""
        self._emit_content(buf[:i], content)
        self._segment = ""
        self._json = _JsonCall() if self.fmt.streams_arguments else None
        return buf[i + len(start) :]

    def _emit_content(self, text: str, content: list[str]) -> None:
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        content.append(kept)

    # ---- inside a call segment ----

    def _in_segment(self, text: str, deltas: list, content: list[str]) -> str:
        """Add text to the open segment; returns the text after its end marker, if it closed."""
        seen = len(self._segment)
        self._segment += text
        end = self.fmt.end
        i = self._segment.find(end, max(0, seen - len(end) + 1)) if end else -1
        if i >= 0:
            segment, rest = self._segment[:i], self._segment[i + len(end) :]
            self._close(segment, deltas, content, complete=True)
            return rest
        if self._json is not None:
            keep = partial_suffix(self._segment, end) if end else 0
            self._json.advance(self._segment[: len(self._segment) - keep], self, deltas)
        return ""

    def _close(self, segment: str, deltas: list, content: list[str], complete: bool) -> None:
        """The segment ended (its end marker, or the end of the output): emit its calls."""
        self._segment = None
        json_call, self._json = self._json, None
        if json_call is not None:
            json_call.advance(segment, self, deltas)
            if json_call.index is not None:  # streamed: its name and arguments are already out
                return
        try:
            parsed = self.fmt.parse(segment, self.tools)
        except Exception:  # mlx-lm's parsers raise anything from ValueError to SyntaxError
            parsed = None
        calls = parsed if isinstance(parsed, list) else [parsed] if parsed else []
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            # Not a call after all: the text goes out as content, nothing is lost.
            end = self.fmt.end if complete else ""
            self._emit_content(self.fmt.start + segment + end, content)
            return
        for call in calls:
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            deltas.append(ToolCallDelta(self._next_index(), new_call_id(), call["name"], arguments))

    def _next_index(self) -> int:
        self._space = ""  # whitespace before a call is layout, not content
        self.calls += 1
        return self.calls - 1


class _JsonCall:
    """A `{"name": ..., "arguments": ...}` segment: the name once known, then the arguments as they come."""

    def __init__(self):
        self.index: int | None = None  # set once the header (name) is out
        self.failed = False  # not this shape: the whole segment is parsed at its end
        self.sent = 0  # how much of the value went out
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def advance(self, body: str, parser: ToolCallParser, deltas: list) -> None:
        if self.failed or self.done:
            return
        if self.index is None:
            m = _JSON_HEADER.match(body, partial=True)
            if m is None:
                self.failed = True
                return
            if m.partial or m.end() == len(body):
                return  # the name is not complete yet, or the value has not started
            if body[m.end()] not in "{[":
                self.failed = True  # arguments as a JSON string: parsed whole at the end
                return
            self.index = parser._next_index()
            self.sent = m.end()
            deltas.append(ToolCallDelta(self.index, new_call_id(), m.group(1), ""))
        end = self.sent
        for ch in body[self.sent :]:
            end += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    break
        if end > self.sent:
            deltas.append(ToolCallDelta(self.index, arguments=body[self.sent : end]))
            self.sent = end
