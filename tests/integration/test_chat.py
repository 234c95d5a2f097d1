"""OpenAI chat completions through the official SDK and raw HTTP, validated against OpenAI's schemas."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from openai_schema import assert_valid

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list:
    """Every `data:` payload of a stream, in order ("[DONE]" kept as a string)."""
    frames = response.text.split("\n\n")
    assert frames[-1] == "", "the stream must end with a blank line"
    out = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_non_streaming_response_matches_openai_schema(client):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "max_tokens": 8})
    assert r.status_code == 200
    body = r.json()
    assert_valid("CreateChatCompletionResponse", body)
    assert body["model"] == "m"
    assert body["id"].startswith("chatcmpl-")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["timings"]["predicted_n"] == usage["completion_tokens"]


def test_stream_is_role_content_final_then_done(client):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "max_tokens": 12, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in chunks[1:-1])
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 12
    timings = final["timings"]
    assert set(timings) == {
        "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
        "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n",
    }
    assert timings["predicted_n"] == 12
    assert len({c["id"] for c in chunks}) == 1


def test_streamed_text_equals_non_streamed_text(client):
    req = {"model": "m", "messages": HELLO, "max_tokens": 20, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    chunks = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}))[:-1]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole
    assert whole


def test_openai_sdk_sync(sdk):
    out = sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content


def test_openai_sdk_sync_streaming_with_include_usage(sdk):
    stream = sdk.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_openai_sdk_async_streaming_and_not(tiny_server):
    async def main():
        sdk = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
        whole = await sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0)
        stream = await sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await sdk.close()
        return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(main())
    assert whole == streamed


def test_models_list_matches_schema_and_model_id(client):
    body = client.get("/v1/models").json()
    assert_valid("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["owned_by"] == "mlx"


def test_health(client):
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_jan_style_request_with_llama_cpp_keys_and_null_content(client):
    """What Jan really sends: llama.cpp sampling keys, thread_id, reasoning_content, tool turns."""
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What is the weather?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call a tool.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
        ],
        "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1, "repeat_last_n": 64,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "thread_id": "t1",
        "chat_template_kwargs": {}, "max_tokens": 4, "stream": False,
        "temperature": None, "top_p": None, "user": "u", "metadata": {"a": "b"},
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
