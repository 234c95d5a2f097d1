"""Reasoning split, streaming = non-streaming, and the chat-template options, on the tiny Qwen3.

Greedy decoding of that model answers `<think>Okay</think>\\n\\nHello` (tests/tiny_qwen3.py).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import ServerProcess
from openai_schema import assert_valid
from integration.test_tools import TOOLS

HI = [{"role": "user", "content": "Hi!"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["Ada", "Alan"]}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": HI, **body}, timeout=120)
    assert r.status_code == 200, r.text
    assert_valid("CreateChatCompletionResponse", r.json())
    return r.json()


def streamed(server, **body) -> tuple[dict, list[dict]]:
    """The streamed answer accumulated the way SDKs do: the message, and the chunks."""
    body = {"model": "m", "messages": HI, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(f) for f in frames[:-1]]
    message: dict = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c)
        delta = c["choices"][0]["delta"]
        for key in ("content", "reasoning_content", "reasoning"):
            message[key] += delta.get(key) or ""
        for d in delta.get("tool_calls", []):
            call = message["tool_calls"].setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = d.get("id") or call["id"]
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    message["finish_reason"] = chunks[-1]["choices"][0]["finish_reason"]
    return message, chunks


def test_think_block_becomes_reasoning_content(qwen3_server):
    message = complete(qwen3_server, temperature=0, max_tokens=20)["choices"][0]["message"]
    assert message["reasoning_content"] == "Okay"
    assert message["content"] == "Hello"


def test_streamed_reasoning_comes_as_reasoning_content_deltas(qwen3_server):
    message, chunks = streamed(qwen3_server, temperature=0, max_tokens=20)
    assert (message["reasoning_content"], message["content"]) == ("Okay", "Hello")
    assert all("<think>" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_enable_thinking_false_gives_no_reasoning(qwen3_server):
    message = complete(qwen3_server, temperature=0, max_tokens=20,
                       chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["content"] == "Hello"
    assert "reasoning_content" not in message


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    ],
    ids=["text", "tools-required", "tools-auto", "json-schema"],
)
def test_streaming_and_non_streaming_give_the_same_greedy_answer(qwen3_server, extra):
    body = {"temperature": 0, "max_tokens": 120, **extra}
    whole = complete(qwen3_server, **body)["choices"][0]
    message, _ = streamed(qwen3_server, **body)
    assert message["content"] == whole["message"]["content"]
    assert message["reasoning_content"] == whole["message"].get("reasoning_content", "")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])]
    assert [(c["name"], c["arguments"]) for _, c in sorted(message["tool_calls"].items())] == calls
    assert message["finish_reason"] == whole["finish_reason"]


def test_json_schema_after_reasoning_parses_and_validates(qwen3_server):
    """A reasoning model thinks first; the JSON the grammar enforces is the content after it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    for seed in range(3):
        choice = complete(qwen3_server, temperature=1.0, seed=seed, max_tokens=100, response_format=fmt)["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["reasoning_content"] == "Okay"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


@pytest.fixture(scope="module")
def thinking_template_server(qwen3_model_dir, qwen3_tokenizer_dir, tmp_path_factory):
    """--chat-template: Qwen3's template with the generation prompt opening <think>; --reasoning-format reasoning."""
    template = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>' }}")
    assert opened != template
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(opened)
    server = ServerProcess("--model", str(qwen3_model_dir), "--chat-template", str(path), "--reasoning-format", "reasoning")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_prompt_that_opens_think_makes_the_output_start_as_reasoning(thinking_template_server):
    """The model writes `Okay</think>\\n\\nHello`: no opening tag, yet `Okay` is reasoning."""
    message = complete(thinking_template_server, temperature=0, max_tokens=20)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Okay", "Hello")
    assert "reasoning_content" not in message


def test_reasoning_format_reasoning_names_the_streamed_field_reasoning(thinking_template_server):
    message, _ = streamed(thinking_template_server, temperature=0, max_tokens=20)
    assert (message["reasoning"], message["content"], message["reasoning_content"]) == ("Okay", "Hello", "")
