"""Tool calls with the real Qwen3 tokenizer and template on a tiny model: parsed, streamed, enforced.

The model's weights are random (see tests/tiny_qwen3.py), so only constrained decoding makes
its calls well-formed: every call below is checked against its tool's JSON schema.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import ServerProcess
from openai_schema import assert_valid

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "units": {"enum": ["C", "F"]},
            },
            "required": ["city"],
        },
    }},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC", "JST"]}}, "required": ["tz"]},
    }},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture
def sdk(qwen3_server):
    return openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0)


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(server, **body) -> list[dict]:
    body = {"model": "m", "messages": ASK, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def assert_calls_valid(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.fixture(scope="module")
def two_call_seed(qwen3_server) -> int:
    """A seed for which the model (at temperature 1) makes exactly two calls; it sometimes makes one or three."""
    for seed in range(40):
        body = chat(qwen3_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
        if len(body["choices"][0]["message"].get("tool_calls") or []) == 2:
            return seed
    pytest.fail("no seed in 0..39 gave two tool calls")


def test_tool_choice_required_gives_calls_whose_arguments_match_the_schema(qwen3_server):
    body = chat(qwen3_server, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=100)
    assert_valid("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert_calls_valid(choice["message"]["tool_calls"])
    assert choice["message"]["content"] == ""


def test_named_tool_choice_calls_that_tool_with_valid_arguments(qwen3_server):
    for name in SCHEMAS:
        body = chat(qwen3_server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                    temperature=0, max_tokens=100)
        calls = body["choices"][0]["message"]["tool_calls"]
        assert_calls_valid(calls)
        assert {c["function"]["name"] for c in calls} == {name}


def test_required_calls_are_valid_at_temperature_one(qwen3_server):
    for seed in range(5):
        body = chat(qwen3_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        assert_calls_valid(body["choices"][0]["message"]["tool_calls"])


def test_two_parallel_calls_stream_with_indexes_0_and_1(qwen3_server, two_call_seed):
    chunks = stream_chunks(qwen3_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=two_call_seed, max_tokens=200)
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert sorted({d["index"] for d in deltas}) == [0, 1]
    for index in (0, 1):
        first = next(d for d in deltas if d["index"] == index)
        assert first["id"].startswith("call_") and first["function"]["name"] in SCHEMAS, "id and name come first"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool_call>" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_openai_sdk_stream_helper_accumulates_two_parallel_calls(qwen3_server, sdk, two_call_seed):
    expected = chat(qwen3_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=two_call_seed, max_tokens=200)
    with sdk.chat.completions.stream(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                     temperature=1.0, seed=two_call_seed, max_tokens=200) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert len(calls) == 2
    assert len({c.id for c in calls}) == 2
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected["choices"][0]["message"]["tool_calls"]
    ]


def test_parallel_tool_calls_false_gives_one_call(qwen3_server, two_call_seed):
    body = chat(qwen3_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=1.0, seed=two_call_seed, max_tokens=200)
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_choice_none_answers_without_calls(qwen3_server):
    body = chat(qwen3_server, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=50)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Hello"


def test_tool_choice_auto_lets_the_model_answer_in_text(qwen3_server):
    body = chat(qwen3_server, tools=TOOLS, temperature=0, max_tokens=50)
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_assistant_tool_call_and_tool_result_continue_the_conversation(qwen3_server, sdk):
    """The turn after a tool result: the SDK's own message shapes are accepted and rendered."""
    first = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=50)
    assert second.choices[0].message.content == "Hello"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "xs": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(qwen3_server, body, param):
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert_valid("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param


def test_unsupported_schema_keyword_is_named_in_the_error(qwen3_server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": ASK, "tools": tools, "tool_choice": "required"})
    assert "uniqueItems" in r.json()["error"]["message"]


def test_unknown_tool_call_parser_is_a_startup_error(qwen3_model_dir):
    server = ServerProcess("--model", str(qwen3_model_dir), "--tool-call-parser", "nope")
    assert server.proc.wait(120) != 0
    assert "--tool-call-parser" in server.stderr()
    assert not any("listening" in line for line in server.all_lines())


def test_a_model_without_a_tool_format_still_makes_required_calls(client):
    """SmolLM2's template knows no tools: calls are written (and enforced) as JSON in <tool_call>."""
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                  "parallel_tool_calls": False, "temperature": 0, "max_tokens": 80})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert len(choice["message"]["tool_calls"]) == 1
    assert_calls_valid(choice["message"]["tool_calls"])
