"""Bounds on what one request may ask for, so no client can make the server do unbounded work.

Small checks that each protocol's serving code applies to its own fields; each raises a 400
naming the field. Stop strings are bounded in api/prompt.py, max_tokens by the context window.
"""

from __future__ import annotations

import json
import re

from mlx_server.api.errors import APIError

MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256  # per message
MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOLS_JSON_BYTES = 512 * 1024  # all tool definitions together, as JSON
MAX_JSON_DEPTH = 64  # tool schemas and template kwargs are walked recursively by the template
# apply_chat_template's own arguments: a client must not replace the template (a sandboxed but
# unbounded program) or change what rendering returns.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_count(items, limit: int, param: str, what: str) -> None:
    if items is not None and len(items) > limit:
        raise APIError(400, f"{param}: at most {limit} {what} are allowed, got {len(items)}", param=param)


def check_tools(tools, param: str = "tools") -> None:
    """Tool definitions: how many, how large, how deeply nested."""
    if not tools:
        return
    check_count(tools, MAX_TOOLS, param, "tools")
    check_depth(tools, param)
    size = len(json.dumps(tools, default=str))
    if size > MAX_TOOLS_JSON_BYTES:
        raise APIError(400, f"{param}: the tool definitions are {size} bytes of JSON; at most {MAX_TOOLS_JSON_BYTES} are allowed", param=param)


def check_depth(value, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """JSON nested deeper than `limit` would exhaust the recursion of whatever walks it."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise APIError(400, f"{param}: nested more than {limit} levels deep", param=param)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


def check_chat_request(req) -> None:
    """An OpenAI chat request: messages, content parts, tools, template kwargs."""
    check_count(req.messages, MAX_MESSAGES, "messages", "messages")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            check_count(m.content, MAX_CONTENT_PARTS, f"messages[{i}].content", "content parts")
    check_tools(getattr(req, "tools", None))
    if req.chat_template_kwargs:
        check_template_kwargs(req.chat_template_kwargs)


def check_template_kwargs(kwargs: dict, param: str = "chat_template_kwargs") -> None:
    """Extra variables for the chat template (`enable_thinking`...), never its own arguments."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"{param}.{key}: this key is reserved by the server", param=f"{param}.{key}")
    check_depth(kwargs, param)


_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)


def has_lone_surrogate(body: bytes) -> bool:
    """Whether JSON text holds a UTF-16 surrogate that is not half of an escaped pair.

    Python's json accepts `"\\ud800"` (and raw surrogate bytes), but such a string cannot be
    encoded again: it would fail in the tokenizer or when echoed in a response.
    """
    if not _SURROGATE_HINT.search(body):
        return False
    if re.search(rb"\xed[\xa0-\xbf]", body):
        return True  # a surrogate encoded as raw bytes: never valid UTF-8
    high_end = None  # where an escaped high surrogate ended, until its low half follows
    for m in _ESCAPE.finditer(body):
        code = int(m.group(1), 16) if m.group(1) else 0
        if high_end is not None:
            if 0xDC00 <= code <= 0xDFFF and m.start() == high_end:
                high_end = None
                continue
            return True
        if 0xDC00 <= code <= 0xDFFF:
            return True
        if 0xD800 <= code <= 0xDBFF:
            high_end = m.end()
    return high_end is not None
