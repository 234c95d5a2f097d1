"""Bad input on the Anthropic, Responses, legacy completions and tokenize routes: each gets its
own protocol's error shape and status, and the server keeps serving."""

from __future__ import annotations

import pytest

from openai_schema import assert_valid

MESSAGES, COUNT, RESPONSES, COMPLETIONS = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BIG = "word " * 3000  # over the test server's 1024-token context
JSON = {"headers": {"content-type": "application/json"}}


def msg(**fields):
    return {"json": {"model": "m", "max_tokens": 5, "messages": HI, **fields}}


def user_blocks(*blocks):
    return msg(messages=[{"role": "user", "content": list(blocks)}])


# (name, method, path, httpx kwargs, status, Anthropic error type, text the message must contain)
ANTHROPIC_CASES = [
    ("invalid json", "POST", MESSAGES, {"content": b"{nope", **JSON}, 400, "invalid_request_error", "not valid JSON"),
    ("missing max_tokens", "POST", MESSAGES, {"json": {"model": "m", "messages": HI}}, 400, "invalid_request_error", "max_tokens"),
    ("zero max_tokens", "POST", MESSAGES, msg(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    ("empty messages", "POST", MESSAGES, msg(messages=[]), 400, "invalid_request_error", "messages"),
    ("system role in messages", "POST", MESSAGES, msg(messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error", "messages[0].role"),
    ("unknown block type", "POST", MESSAGES, user_blocks({"type": "hologram"}), 400, "invalid_request_error", "messages[0].content[0]"),
    ("tool_use without id", "POST", MESSAGES, msg(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
     400, "invalid_request_error", "messages[0].content[0].id"),
    ("tool_use in a user message", "POST", MESSAGES, user_blocks({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
     400, "invalid_request_error", "user message"),
    ("image to a text-only model", "POST", MESSAGES,
     user_blocks({"type": "text", "text": "see"}, {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}),
     400, "invalid_request_error", "messages[0].content[1]"),
    ("image source incomplete", "POST", MESSAGES, user_blocks({"type": "image", "source": {"type": "base64", "data": "AA"}}),
     400, "invalid_request_error", "media_type"),
    ("document block", "POST", MESSAGES, user_blocks({"type": "document", "source": {"type": "text", "data": "x"}}),
     400, "invalid_request_error", "document blocks are not supported"),
    ("temperature above 1", "POST", MESSAGES, msg(temperature=1.5), 400, "invalid_request_error", "temperature"),
    ("stop_sequences a string", "POST", MESSAGES, msg(stop_sequences="END"), 400, "invalid_request_error", "stop_sequences"),
    ("too many stop_sequences", "POST", MESSAGES, msg(stop_sequences=[f"s{i}" for i in range(40)]), 400, "invalid_request_error", "stop_sequences"),
    ("tool_choice names no tool", "POST", MESSAGES, msg(tool_choice={"type": "tool", "name": "nope"}), 400, "invalid_request_error", "tool_choice.name"),
    ("server tool", "POST", MESSAGES, msg(tools=[{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]),
     400, "invalid_request_error", "tools[0].type"),
    ("thinking enabled without budget", "POST", MESSAGES, msg(thinking={"type": "enabled"}), 400, "invalid_request_error", "budget_tokens"),
    ("prompt over the context", "POST", MESSAGES, msg(messages=[{"role": "user", "content": BIG}]), 400, "invalid_request_error", "1024"),
    ("11 MiB body", "POST", MESSAGES, {"content": b"{" + b" " * (11 * 1024 * 1024) + b"}", **JSON}, 413, "request_too_large", "10 MiB"),
    ("wrong method", "GET", MESSAGES, {}, 405, "invalid_request_error", "GET"),
    ("count_tokens without messages", "POST", COUNT, {"json": {"model": "m"}}, 400, "invalid_request_error", "messages"),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,kind,needle", ANTHROPIC_CASES, ids=[c[0] for c in ANTHROPIC_CASES])
def test_anthropic_bad_input_gets_an_anthropic_error(client, name, method, path, kwargs, status, kind, needle):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == kind
    assert needle.lower() in body["error"]["message"].lower(), body
    assert client.get("/health").json() == {"status": "ok"}


def resp(**fields):
    return {"json": {"model": "m", "input": "hi", **fields}}


def comp(**fields):
    return {"json": {"model": "m", "prompt": "hi", **fields}}


# (name, method, path, httpx kwargs, status, text the message must contain, expected param)
OPENAI_CASES = [
    ("responses: missing input", "POST", RESPONSES, {"json": {"model": "m"}}, 400, "input", "input"),
    ("responses: input a number", "POST", RESPONSES, resp(input=5), 400, "input", "input"),
    ("responses: unknown item type", "POST", RESPONSES, resp(input=[{"type": "web_search_call", "id": "x"}]), 400, "type must be one of", "input[0]"),
    ("responses: message without role", "POST", RESPONSES, resp(input=[{"type": "message", "content": "x"}]), 400, "role", "input[0].role"),
    ("responses: function_call without call_id", "POST", RESPONSES, resp(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
     400, "call_id", "input[0].call_id"),
    ("responses: item_reference", "POST", RESPONSES, resp(input=[{"type": "item_reference", "id": "msg_1"}]), 400, "item_reference", "input[0]"),
    ("responses: image to a text-only model", "POST", RESPONSES,
     resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]), 400, "text-only", "input[0].content[0]"),
    ("responses: unknown previous_response_id", "POST", RESPONSES, resp(previous_response_id="resp_nope"), 400, "resp_nope", "previous_response_id"),
    ("responses: zero max_output_tokens", "POST", RESPONSES, resp(max_output_tokens=0), 400, "max_output_tokens", "max_output_tokens"),
    ("responses: temperature 3", "POST", RESPONSES, resp(temperature=3), 400, "temperature", "temperature"),
    ("responses: hosted tool", "POST", RESPONSES, resp(tools=[{"type": "web_search"}]), 400, "function", "tools[0].type"),
    ("responses: tool_choice names no tool", "POST", RESPONSES, resp(tool_choice={"type": "function", "name": "f"}), 400, "f", "tool_choice.name"),
    ("responses: json_schema without a name", "POST", RESPONSES, resp(text={"format": {"type": "json_schema", "schema": {}}}), 400, "name", "text.format"),
    ("responses: input over the context", "POST", RESPONSES, resp(input=BIG), 400, "1024", "input"),
    ("responses: unknown stored response", "GET", RESPONSES + "/resp_nope", {}, 404, "resp_nope", "response_id"),
    ("completions: missing prompt", "POST", COMPLETIONS, {"json": {"model": "m"}}, 400, "prompt", "prompt"),
    ("completions: prompt an object", "POST", COMPLETIONS, comp(prompt={"text": "x"}), 400, "prompt", "prompt"),
    ("completions: empty prompt list", "POST", COMPLETIONS, comp(prompt=[]), 400, "empty", "prompt"),
    ("completions: unknown token id", "POST", COMPLETIONS, comp(prompt=[1, 99999999]), 400, "99999999", "prompt"),
    ("completions: suffix without fill-in-the-middle", "POST", COMPLETIONS, comp(suffix="x"), 400, "fill-in-the-middle", "suffix"),
    ("completions: zero max_tokens", "POST", COMPLETIONS, comp(max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("completions: n of 2", "POST", COMPLETIONS, comp(n=2), 400, "n", "n"),
    ("completions: echo a string", "POST", COMPLETIONS, comp(echo="yes"), 400, "echo", "echo"),
    ("completions: too many prompts", "POST", COMPLETIONS, comp(prompt=["x"] * 200), 400, "prompt", "prompt"),
    ("completions: prompt over the context", "POST", COMPLETIONS, comp(prompt=BIG), 400, "1024", "prompt"),
    ("tokenize: nothing to tokenize", "POST", "/tokenize", {"json": {}}, 400, "content", "content"),
    ("tokenize: content and prompt", "POST", "/tokenize", {"json": {"content": "a", "prompt": "b"}}, 400, "exactly one", "prompt"),
    ("detokenize: unknown token id", "POST", "/detokenize", {"json": {"tokens": [99999999]}}, 400, "99999999", "tokens"),
    ("detokenize: tokens not a list", "POST", "/detokenize", {"json": {"tokens": "abc"}}, 400, "tokens", "tokens"),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,needle,param", OPENAI_CASES, ids=[c[0] for c in OPENAI_CASES])
def test_openai_style_bad_input_gets_an_openai_error(client, name, method, path, kwargs, status, needle, param):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert_valid("ErrorResponse", body)
    assert needle.lower() in body["error"]["message"].lower(), body
    assert body["error"]["param"] == param, body
    assert client.get("/health").json() == {"status": "ok"}


def test_every_new_route_still_generates_after_all_bad_inputs(client):
    for _, method, path, kwargs, *_ in ANTHROPIC_CASES + OPENAI_CASES:
        client.request(method, path, **kwargs)
    assert client.post(MESSAGES, **msg(max_tokens=2)).json()["usage"]["output_tokens"] <= 2
    assert client.post(RESPONSES, **resp(max_output_tokens=2)).json()["usage"]["output_tokens"] <= 2
    assert client.post(COMPLETIONS, **comp(max_tokens=2)).json()["usage"]["completion_tokens"] <= 2


def test_null_optional_fields_mean_defaults(client):
    nulls = {k: None for k in ("system", "stop_sequences", "stream", "tools", "tool_choice", "thinking", "temperature", "top_p", "top_k")}
    assert client.post(MESSAGES, **msg(**nulls)).status_code == 200
    nulls = {k: None for k in ("instructions", "previous_response_id", "store", "stream", "max_output_tokens", "temperature",
                               "top_p", "tools", "tool_choice", "text", "reasoning", "metadata")}
    assert client.post(RESPONSES, **resp(max_output_tokens=2, **{k: v for k, v in nulls.items() if k != "max_output_tokens"})).status_code == 200
    nulls = {k: None for k in ("suffix", "echo", "best_of", "logprobs", "stop", "stream", "temperature", "n")}
    assert client.post(COMPLETIONS, **comp(max_tokens=2, **nulls)).status_code == 200
