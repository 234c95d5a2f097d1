"""Grammars for what one request's output must look like, in llguidance's Lark dialect.

They are written from the same facts the output parsers read (the reasoning markers, the
tool-call format), so what constrained decoding lets the model write, chat_output parses:
an optional reasoning block, then free text with tool calls (`auto`), only tool calls
(`required` or a named tool), or one JSON value (`response_format`).

A marker that is one special token (Qwen's `<tool_call>`) must be named as a token (`<[id]>`):
free-text terminals can never produce special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

# How constrained JSON is spaced: the way chat templates render it (`tojson`, Python's json).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

SpecialToken = Callable[[str], "int | None"]
NL = "\n"


@dataclass(frozen=True)
class CallSyntax:
    """How one format writes calls; `call` gives the Lark for one call of a tool."""

    per_segment: bool  # one call per start..end segment (else one segment holds them all)
    sep: str  # between calls (between segments when per_segment)
    call: Callable[["_Writer", str, dict], str]
    open: str = ""  # around the calls inside a shared segment
    close: str = ""


def _json_tools(w: "_Writer", name: str, params: dict) -> str:
    head = "\n" + json.dumps({"name": name})[:-1] + ', "arguments": '
    return f"{_lit(head)} {w.json(params)} {_lit('}' + NL)}"


def _mistral(w: "_Writer", name: str, params: dict) -> str:
    return f"{_lit(name + '[ARGS]')} {w.json(params)}"


def _kimi_k2(w: "_Writer", name: str, params: dict) -> str:
    return (
        f"{w.mark('<|tool_call_begin|>')} {_lit('functions.' + name + ':')} /[0-9]{{1,3}}/ "
        f"{w.mark('<|tool_call_argument_begin|>')} {w.json(params)} {w.mark('<|tool_call_end|>')}"
    )


def _qwen3_coder(w: "_Writer", name: str, params: dict) -> str:
    def param(key: str, schema: dict) -> str:
        close = "\n</parameter>\n"
        value = w.raw_string(schema, close) if _is_string(schema) else f"{w.json(schema)} {_lit(close)}"
        return f"{_lit(f'<parameter={key}>' + NL)} {value}"

    head = f"{NL}<function={name}>{NL}"
    return f"{_lit(head)} {w.params(params, param)} {_lit('</function>' + NL)}"


def _pythonic(w: "_Writer", name: str, params: dict) -> str:
    # Values as JSON: mlx-lm's pythonic parser reads JSON literals (true/false/null) too.
    def param(key: str, schema: dict) -> str:
        return f"{_lit(key + '=')} {w.json(schema)}"

    return f"{_lit(name + '(')} {w.params(params, param, sep=', ')} {_lit(')')}"


def _llama3(w: "_Writer", name: str, params: dict) -> str:
    head = json.dumps({"name": name})[:-1] + ', "parameters": '
    return f"{_lit(head)} {w.json(params)} {_lit('}')}"


CALL_SYNTAX: dict[str, CallSyntax] = {
    "json_tools": CallSyntax(per_segment=True, sep="\n", call=_json_tools),
    "qwen3_coder": CallSyntax(per_segment=True, sep="\n", call=_qwen3_coder),
    "mistral": CallSyntax(per_segment=False, sep="", call=_mistral),
    "kimi_k2": CallSyntax(per_segment=False, sep="", call=_kimi_k2),
    "pythonic": CallSyntax(per_segment=False, sep=", ", call=_pythonic, open="[", close="]"),
    # No markers: the calls are the whole output (tool_calls.py).
    "llama3_json": CallSyntax(per_segment=False, sep="; ", call=_llama3),
}


def can_constrain_tools(format_name: str | None) -> bool:
    return format_name in CALL_SYNTAX


@dataclass
class OutputShape:
    """What the output must be; see `output_grammar`."""

    reasoning_markers: tuple[str, str] | None = None
    starts_in_reasoning: bool = False
    tool_format: tuple[str, str, str] | None = None  # (format name, start marker, end marker)
    tools: list[dict] | None = None  # OpenAI-shaped tools the calls may use
    tools_required: bool = False  # "required" or a named tool: calls only, at least one
    parallel_tool_calls: bool = True
    json_schema: dict | None = None  # the answer is one JSON value of this schema


def output_grammar(shape: OutputShape, special: SpecialToken) -> str | None:
    """The Lark grammar for `shape`, or None when nothing needs constraining."""
    w = _Writer(special)
    tools = bool(shape.tools) and shape.tool_format is not None and can_constrain_tools(shape.tool_format[0])
    calls, rest = w.calls(shape) if tools else (None, None)
    json_rule = w.json(shape.json_schema) if shape.json_schema is not None else None
    if calls is not None and not shape.tools_required and json_rule is None and not shape.tool_format[1]:
        # `auto` in a format without a start marker (Llama 3): the output is calls or any text,
        # and any text admits calls: nothing to constrain.
        calls = None
    if calls is None and json_rule is None:
        return None
    if calls is None:
        body = json_rule
    elif shape.tools_required:
        body = f"WS {calls}"
    elif json_rule is not None:
        body = f"WS ({calls} | {json_rule})"
    else:
        body = w.free_text_with(rest, shape)
    prefix = ""
    if shape.reasoning_markers:
        start, end = shape.reasoning_markers
        w.rules.append(f"think_rest: {w.text_until(end)} WS")
        prefix = "think_rest " if shape.starts_in_reasoning else f"({w.mark(start)} think_rest)? "
    rules = "\n".join(w.rules)
    return f"%llguidance {{}}\nstart: {prefix}{body}\nWS: /[ \\t\\r\\n]{{0,4}}/\nTEXT: /(?s:.*)/\n{rules}\n"


class _Writer:
    def __init__(self, special: SpecialToken):
        self.special = special
        self.rules: list[str] = []
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def mark(self, text: str) -> str:
        token = self.special(text)
        return f"<[{token}]>" if token is not None else _lit(text)

    def json(self, schema: dict) -> str:
        return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})

    def raw_string(self, schema: dict, close: str) -> str:
        """A string parameter written bare (XML formats): one of its `enum` values, else any text; then `close`."""
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices is not None:
            return f"({' | '.join(_lit(str(c)) for c in choices)}) {_lit(close)}"
        return self.text_until(close)

    def text_until(self, marker: str) -> str:
        """Any text, then `marker` (the first one ends it)."""
        token = self.special(marker)
        if token is not None:
            return f"TEXT <[{token}]>"  # free text cannot contain a special token
        rule = self.name("until")
        self.rules.append(f"{rule}[lazy]: /(?s:.*)/ {_lit(marker)}")
        return rule

    def params(self, params: dict, item: Callable[[str, dict], str], sep: str = "") -> str:
        """The properties in schema order: required ones always, the others optionally."""
        props = list((params.get("properties") or {}).items())
        required = set(params.get("required") or [])
        # rule (i, after): the properties from i on, `after` whether one was already written.
        names = {(i, after): self.name("p") for i in range(len(props) + 1) for after in (False, True)}
        for (i, after), rule in names.items():
            if i == len(props):
                self.rules.append(f"{rule}: ")
                continue
            key, schema = props[i]
            piece = (f"{_lit(sep)} " if sep and after else "") + item(key, schema)
            take = f"{piece} {names[(i + 1, True)]}"
            skip = names[(i + 1, after)]
            self.rules.append(f"{rule}: {take}" if key in required else f"{rule}: {take} | {skip}")
        return names[(0, False)]

    def calls(self, shape: OutputShape) -> tuple[str, str]:
        """(rule for the calls, rule for what follows the start marker of one segment)."""
        fmt, start, end = shape.tool_format
        syntax = CALL_SYNTAX[fmt]
        alternatives = []
        for tool in shape.tools:
            fn = tool["function"]
            params = closed(fn.get("parameters") or {"type": "object", "properties": {}})
            rule = self.name("call")
            self.rules.append(f"{rule}: {syntax.call(self, fn['name'], params)}")
            alternatives.append(rule)
        one = self.name("one_call")
        self.rules.append(f"{one}: {' | '.join(alternatives)}")
        start_mark, end_mark = (self.mark(start) if start else ""), (self.mark(end) if end else "")
        sep = f"{_lit(syntax.sep)} " if syntax.sep else ""

        def repeated(item: str) -> str:
            return f"{item} ({sep}{item})*" if shape.parallel_tool_calls else item

        rest, calls = self.name("segment_rest"), self.name("calls")
        if syntax.per_segment:
            self.rules.append(f"{rest}: {one} {end_mark}")
            self.rules.append(f"{calls}: {repeated(f'{start_mark} {rest}')}")
        else:
            inner = [_lit(syntax.open) if syntax.open else "", repeated(one), _lit(syntax.close) if syntax.close else ""]
            self.rules.append(f"{rest}: {' '.join(x for x in inner if x)} {end_mark}")
            self.rules.append(f"{calls}: {start_mark} {rest}" if start_mark else f"{calls}: {rest}")
        return calls, rest

    def free_text_with(self, rest: str, shape: OutputShape) -> str:
        """`auto`: any text; once a start marker is written, a valid call must follow it."""
        start = shape.tool_format[1]
        token = self.special(start)
        if token is not None:  # free text cannot produce the special start token
            return f"TEXT (<[{token}]> {rest} TEXT)*" if shape.parallel_tool_calls else f"TEXT (<[{token}]> {rest} WS)?"
        # llguidance's lazy lexeme: any text up to the first marker, which must then start a call.
        head = self.name("text_then_call")
        self.rules.append(f"{head}[lazy]: /(?s:.*)/ {_lit(start)}")
        return f"({head} {rest})* TEXT" if shape.parallel_tool_calls else f"TEXT | {head} {rest} WS"


def closed(schema):
    """Tool arguments hold the declared parameters only: objects with `properties` and no say
    on `additionalProperties` get `false` (else a small model may invent keys forever)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def _is_string(schema: dict) -> bool:
    """Written bare by XML formats: a string, or a choice among strings."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return all(isinstance(c, str) for c in choices)
    return schema.get("type") == "string"
