"""Anthropic Messages through the official `anthropic` SDK against a real server (SPEC §6)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from conftest import ServerProcess
from protocol_fakes import sse_frames

HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "input_schema": {"type": "object", "properties": {"cityName": {"type": "string"}}, "required": ["cityName"]},
}
KEY = "anthropic-key"


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(sdk) -> str:
    return sdk.messages.create(model="tiny", max_tokens=20, messages=HELLO, **GREEDY).content[0].text


def test_create_returns_a_message_that_stops_at_max_tokens(sdk):
    message = sdk.messages.create(model="claude-any", max_tokens=6, messages=HELLO, system="You are terse.", **GREEDY)
    assert message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant" and message.model == "claude-any"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 6


def test_stream_get_final_message_equals_create(sdk, reference):
    with sdk.messages.stream(model="tiny", max_tokens=20, messages=HELLO, **GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == reference
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20


def test_raw_stream_is_message_start_ping_blocks_message_delta_message_stop(client):
    body = {"model": "tiny", "max_tokens": 5, "messages": HELLO, "stream": True}
    r = client.post("/v1/messages", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.content)
    names = [name for name, _ in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in frames)
    assert {data.get("index") for name, data in frames if name.startswith("content_block")} == {0}
    assert frames[0][1]["message"]["usage"]["input_tokens"] > 0


def test_stop_sequences_end_the_text_and_are_reported(sdk, reference):
    stop = reference[3:6]
    expected = reference[: reference.index(stop)]
    message = sdk.messages.create(model="tiny", max_tokens=20, messages=HELLO, stop_sequences=["\u2603", stop], **GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in message.content) == expected
    with sdk.messages.stream(model="tiny", max_tokens=20, messages=HELLO, stop_sequences=[stop], **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_round_trip_gets_an_answer(sdk):
    """The client ran the tool the model asked for and sends the result back; the model answers."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I will look it up."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"cityName": "Paris"}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny, 24C"}]},
    ]
    answer = sdk.messages.create(model="tiny", max_tokens=8, tools=[WEATHER_TOOL], tool_choice={"type": "auto"},
                                 messages=messages, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text"
    without_tool_turns = sdk.messages.count_tokens(model="tiny", messages=messages[:1], tools=[WEATHER_TOOL])
    with_tool_turns = sdk.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    assert with_tool_turns.input_tokens > without_tool_turns.input_tokens + 10


def test_count_tokens_is_the_prompt_that_create_uses(sdk):
    kwargs = {"model": "tiny", "messages": HELLO, "system": [{"type": "text", "text": "Be kind."}]}
    counted = sdk.messages.count_tokens(**kwargs).input_tokens
    usage = sdk.messages.create(max_tokens=2, **kwargs).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens


def test_sampling_thinking_and_metadata_fields_are_accepted(sdk):
    message = sdk.messages.create(
        model="tiny", max_tokens=3, messages=HELLO, thinking={"type": "disabled"}, metadata={"user_id": "u"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
    )
    assert message.usage.output_tokens <= 3


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--model-id", "tiny", "--api-key", KEY).wait_ready()
    yield server
    server.stop()


@pytest.mark.parametrize("credentials", [{"api_key": KEY}, {"auth_token": KEY}], ids=["x-api-key", "bearer"])
def test_auth_by_x_api_key_or_bearer(keyed_server, credentials):
    sdk = anthropic.Anthropic(base_url=keyed_server.url, max_retries=0, **credentials)
    assert sdk.messages.create(model="tiny", max_tokens=2, messages=HELLO).usage.output_tokens <= 2


def test_wrong_key_is_an_anthropic_401(keyed_server):
    sdk = anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk.messages.create(model="tiny", max_tokens=2, messages=HELLO)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Unauthorized"}}
    r = httpx.post(keyed_server.url + "/v1/messages/count_tokens", json={})
    assert r.status_code == 401 and r.json()["type"] == "error"


# ---- assistant prefill: a final assistant message is continued ----

PREFILL = "Hello! My name is"
SMOLLM_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                 "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")


def test_a_final_assistant_message_is_continued_and_not_repeated(sdk, client):
    """The answer is what the model writes after the prefill, exactly as a raw completion of the
    prompt that ends inside the assistant's message: the prefill itself is not in it."""
    messages = HELLO + [{"role": "assistant", "content": PREFILL}]
    message = sdk.messages.create(model="tiny", max_tokens=12, messages=messages, **GREEDY)
    raw = client.post("/v1/completions", json={"model": "m", "prompt": SMOLLM_PROMPT + PREFILL, "max_tokens": 12,
                                                "temperature": 0}).json()["choices"][0]["text"]
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == raw
    assert not raw.startswith(PREFILL)
    assert message.usage.output_tokens == 12
    with sdk.messages.stream(model="tiny", max_tokens=12, messages=messages, **GREEDY) as stream:
        assert "".join(stream.text_stream) == raw
    counted = sdk.messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_openai_chat_continues_the_final_message_with_continue_final_message(client, sdk):
    messages = HELLO + [{"role": "assistant", "content": PREFILL}]
    body = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}
    chat = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert chat == sdk.messages.create(model="tiny", max_tokens=12, messages=messages, **GREEDY).content[0].text
    body["add_generation_prompt"] = True
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt"


def test_a_stop_sequence_inside_the_prefill_does_not_end_the_answer(sdk):
    """Stop sequences are looked for in what the model writes, not in the prefill."""
    messages = HELLO + [{"role": "assistant", "content": PREFILL}]
    plain = sdk.messages.create(model="tiny", max_tokens=8, messages=messages, **GREEDY)
    stopped = sdk.messages.create(model="tiny", max_tokens=8, messages=messages, stop_sequences=["name"], **GREEDY)
    assert "name" not in plain.content[0].text
    assert stopped.content[0].text == plain.content[0].text and stopped.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_ending_in_whitespace_is_an_anthropic_400(sdk, stream):
    messages = HELLO + [{"role": "assistant", "content": [{"type": "text", "text": "Hello "}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model="tiny", max_tokens=5, messages=messages, stream=stream)
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages: final assistant content cannot end with trailing whitespace"}}


def test_a_prefill_that_opens_think_makes_the_answer_start_in_reasoning(qwen3_server):
    """The tiny Qwen3 writes `</think>\\n\\nHello` after `Okay`: the close ends the prefill's reasoning."""
    sdk = anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0)
    messages = HELLO + [{"role": "assistant", "content": "<think>\nOkay"}]
    message = sdk.messages.create(model="q", max_tokens=20, messages=messages, **GREEDY)
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello")]


def test_a_prefill_before_a_required_tool_call_still_gives_a_parsed_call(qwen3_server):
    sdk = anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Let me check."}]
    message = sdk.messages.create(model="q", max_tokens=80, messages=messages, tools=[WEATHER_TOOL],
                                  tool_choice={"type": "any"}, **GREEDY)
    assert [b.name for b in message.content if b.type == "tool_use"] == ["get_weather"]
    assert all("<tool_call>" not in b.text for b in message.content if b.type == "text")


# ---- thinking.budget_tokens ----

@pytest.fixture(scope="module")
def thinker(qwen3_thinker_dir):
    """A tiny Qwen3 that never stops thinking by itself: `<think>HmmHmmHmm...`, and `\\n\\nHello` after `</think>`."""
    server = ServerProcess("--model", str(qwen3_thinker_dir), "--ctx-size", "1024", "--model-id", "thinker").wait_ready()
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    server.stop()


@pytest.mark.parametrize("budget", [1, 4])
def test_thinking_budget_closes_the_reasoning_and_the_answer_follows(thinker, budget):
    thinking = {"type": "enabled", "budget_tokens": budget}
    message = thinker.messages.create(model="t", max_tokens=40, messages=HELLO, thinking=thinking, **GREEDY)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Hmm" * budget and message.content[1].text == "Hello"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == budget + 5  # <think>, Hmm..., </think>, \n\n, Hello, <|im_end|>
    with thinker.messages.stream(model="t", max_tokens=40, messages=HELLO, thinking=thinking, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


def test_without_a_budget_the_model_thinks_until_max_tokens(thinker):
    message = thinker.messages.create(model="t", max_tokens=30, messages=HELLO, thinking={"type": "adaptive"}, **GREEDY)
    assert [b.type for b in message.content] == ["thinking"] and message.stop_reason == "max_tokens"


def test_thinking_budget_counts_from_a_prefill_that_opened_the_reasoning(thinker):
    messages = HELLO + [{"role": "assistant", "content": "<think>\nHmm"}]
    message = thinker.messages.create(model="t", max_tokens=40, messages=messages,
                                      thinking={"type": "enabled", "budget_tokens": 3}, **GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == [("thinking", "HmmHmmHmm"), ("text", "Hello")]


def test_budget_tokens_not_below_max_tokens_is_an_anthropic_400(thinker):
    with pytest.raises(anthropic.BadRequestError) as e:
        thinker.messages.create(model="t", max_tokens=10, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 10})
    assert e.value.body["type"] == "error" and "`max_tokens` must be greater than `thinking.budget_tokens`" in e.value.body["error"]["message"]
