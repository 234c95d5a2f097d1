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
