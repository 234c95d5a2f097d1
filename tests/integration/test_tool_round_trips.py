"""Real tool calls through the Anthropic and Responses APIs: the model calls a tool (constrained by
tool_choice, so even the tiny model does), the client sends the result back, the model answers."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from conftest import ServerProcess
from openai_schema import assert_valid
from protocol_fakes import RESPONSE_EVENT_SCHEMAS, sse_frames

# ChatML that shows the tools and writes calls as <tool_call>{json}</tool_call> (mlx-lm's json_tools).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"cityName": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["cityName"]}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather now in a city", "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather now in a city", "parameters": SCHEMA}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess("--model", str(tiny_model_dir), "--model-id", "tiny", "--ctx-size", "1024",
                           "--tool-call-parser", "json_tools", "--chat-template", str(template)).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(tool_server):
    return anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def ask_for_the_tool(claude, stream: bool):
    kwargs = dict(model="tiny", max_tokens=60, tools=[ANTHROPIC_TOOL], messages=[{"role": "user", "content": QUESTION}],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    if not stream:
        return claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_tool_use_then_tool_result_then_the_answer(claude, stream):
    call = ask_for_the_tool(claude, stream)
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["cityName"] in ("Paris", "Rome")
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": call.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny, 24C"}]},
    ]
    answer = claude.messages.create(model="tiny", max_tokens=8, tools=[ANTHROPIC_TOOL], messages=messages,
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


def test_anthropic_named_tool_streams_a_tool_use_block(tool_server, client):
    body = {"model": "tiny", "max_tokens": 60, "stream": True, "tools": [ANTHROPIC_TOOL], "temperature": 0,
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": QUESTION}]}
    frames = sse_frames(client.post(tool_server.url + "/v1/messages", json=body).content)
    starts = [d["content_block"] for name, d in frames if name == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "get_weather", {})]
    partial = "".join(d["delta"]["partial_json"] for name, d in frames if name == "content_block_delta")
    assert json.loads(partial)["cityName"] in ("Paris", "Rome")
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_responses_function_call_then_output_then_the_answer(oai):
    call = oai.responses.create(model="tiny", input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert call.status == "completed"
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments)["cityName"] in ("Paris", "Rome")
    answer = oai.responses.create(model="tiny", previous_response_id=call.id, max_output_tokens=6, temperature=0,
                                  input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 24C"}])
    assert answer.output[0].type == "message" and answer.output_text


def test_responses_streamed_function_call_matches_openai_schemas(tool_server, client):
    body = {"model": "tiny", "input": QUESTION, "tools": [RESPONSES_TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0, "stream": True}
    frames = sse_frames(client.post(tool_server.url + "/v1/responses", json=body).content)
    for name, data in frames:
        assert_valid(RESPONSE_EVENT_SCHEMAS[name], data)
    done = [d for name, d in frames if name == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0]["arguments"])["cityName"] in ("Paris", "Rome")
    assert frames[-1][0] == "response.completed"


# Llama 3.1-3.3's way, cut down: tools in the system turn, calls answered as bare JSON with
# "parameters", built-in tools after <|python_tag|>. The server infers the llama3_json format
# from this (no --tool-call-parser).
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Functions: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{%- endfor %}{%- else %}{{ m.content or '' }}{%- endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{#- built-in tools would follow <|python_tag|> #}"
)
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                                "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def llama3_server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "llama3.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    server = ServerProcess("--model", str(tiny_model_dir), "--model-id", "tiny", "--ctx-size", "1024",
                           "--chat-template", str(template)).wait_ready()
    yield server
    server.stop()


def test_llama3_json_calls_plain_and_streamed_then_the_answer(llama3_server):
    oai = openai.OpenAI(base_url=llama3_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model="tiny", tools=[OPENAI_TOOL], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=60, temperature=0)
    raw = oai.chat.completions.with_raw_response.create(messages=messages, **kwargs)
    assert_valid("CreateChatCompletionResponse", raw.http_response.json())
    r = raw.parse()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["cityName"] in ("Paris", "Rome")

    chunks = list(oai.chat.completions.create(messages=messages, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert streamed[0].function.name == "get_weather" and streamed[0].id
    assert json.loads("".join(t.function.arguments or "" for t in streamed)) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    messages += [{"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"}]
    answer = oai.chat.completions.create(model="tiny", messages=messages, tools=[OPENAI_TOOL], tool_choice="none",
                                         max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
