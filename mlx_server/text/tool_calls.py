"""Tool calls out of generated text, in any of mlx-lm's formats, and Llama 3's (feed/finish).

A format is one of mlx-lm's `tool_parsers` modules: `tool_call_start`, `tool_call_end` and
`parse_tool_call(text, tools)`. Text outside the markers is content; a marked segment becomes
one or more calls. For JSON calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen, Hermes) the arguments stream as they are generated; other formats are parsed when
their segment closes.

Llama 3.1-3.3 (`llama3_json`, ours: mlx-lm has none) mark nothing: the whole answer is the call,
`{"name": ..., "parameters": {...}}`, several separated by `;`, sometimes after `<|python_tag|>`.
So an answer that opens with `{` or that tag is held to its end and parsed; if it is not calls
after all, it goes out as content unchanged. An answer that opens with anything else is content.
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
    # With start "" (Llama 3): what an output that is calls opens with; anything else is content.
    openers: tuple[str, ...] = ()

    @property
    def streams_arguments(self) -> bool:
        return self.name == "json_tools"


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_calls(text: str, tools=None) -> list[dict]:
    """Llama 3's calls: JSON objects with `name` and `parameters` (or `arguments`), separated by
    `;` or whitespace, after an optional `<|python_tag|>`. ValueError when the text is anything else."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :]
    decoder, i, calls = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            break
        obj, i = decoder.raw_decode(text, i)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a call")
        arguments = obj.get("parameters", obj.get("arguments", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict) or set(obj) - {"name", "parameters", "arguments", "type"}:
            raise ValueError("not a call")
        calls.append({"name": obj["name"], "arguments": arguments})
    if not calls:
        raise ValueError("no call")
    return calls


_OURS = {"llama3_json": ToolFormat("llama3_json", "", "", parse_llama3_calls, openers=("{", PYTHON_TAG))}


def tool_format_names() -> list[str]:
    return sorted([m.name for m in pkgutil.iter_modules(tool_parsers.__path__)] + list(_OURS))


def tool_format(name: str) -> ToolFormat:
    """mlx-lm's tool parser module `name` (or one of ours) as a ToolFormat; ValueError for an unknown name."""
    if name in _OURS:
        return _OURS[name]
    if name not in tool_format_names():
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(tool_format_names())}")
    m = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, m.tool_call_start, m.tool_call_end, m.parse_tool_call)


def infer_tool_format(tokenizer, chat_template: str | None) -> str | None:
    """The format a model writes, from its tokenizer config or else its chat template and vocabulary."""
    explicit = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
    if explicit:
        return explicit
    inferred = _infer_tool_parser(SimpleNamespace(chat_template=chat_template, get_vocab=tokenizer.get_vocab))
    if inferred is None and chat_template and PYTHON_TAG in chat_template and '"parameters"' in chat_template:
        return "llama3_json"  # Llama 3.1-3.3's templates: custom tools answer in JSON with "parameters"
    return inferred


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
        # A format without a start marker (Llama 3): the output's opening is held until it tells
        # whether the whole output is calls (then one segment to the end) or content.
        self._opening: str | None = "" if fmt.openers else None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        buf = text
        if self._opening is not None:
            buf = self._open(buf)
        while buf:
            if self._segment is None:
                buf = self._content(buf, content)
            else:
                buf = self._in_segment(buf, deltas, content)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._opening is not None:  # the output ended while its opening was undecided
            self._held, self._opening = self._opening, None
        if self._segment is not None:
            self._close(self._segment, deltas, content, complete=False)
        held, self._held = self._held, ""
        tail = self._space + held
        self._space = ""
        if held or not self.calls:
            content.append(tail)
        return "".join(content), deltas

    def _open(self, text: str) -> str:
        """Hold the output's opening until it is decided; returns the text to go on with."""
        self._opening += text
        head = self._opening.lstrip()
        if not head or any(o.startswith(head) and o != head for o in self.fmt.openers):
            return ""  # only whitespace, or a prefix of an opener, so far
        buf, self._opening = self._opening, None
        if any(head.startswith(o) for o in self.fmt.openers):
            self._segment = ""  # calls: everything to the end of the output
            return head
        return buf

    # ---- content between calls ----

    def _content(self, text: str, content: list[str]) -> str:
        """Consume content up to a start marker; returns what follows the marker ("" if none)."""
        start = self.fmt.start
        if not start:  # Llama 3: calls only open the output, so the rest is content
            self._emit_content(self._held + text, content)
            self._held = ""
            return ""
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
