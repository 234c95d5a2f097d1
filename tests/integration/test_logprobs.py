"""logprobs / top_logprobs in OpenAI's shape, streaming and not, per request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from openai_schema import assert_valid

HELLO = [{"role": "user", "content": "Say hello."}]


def logprobs_of(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "temperature": 0, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    assert_valid("CreateChatCompletionResponse", r.json())
    return r.json()


def test_logprobs_give_each_tokens_logprob_and_top_alternatives(client):
    body = logprobs_of(client, logprobs=True, top_logprobs=3)
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    for e in entries:
        tops = e["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert (e["token"], e["logprob"]) == (tops[0]["token"], tops[0]["logprob"]), "greedy takes the most likely"
        assert e["logprob"] <= 0 and bytes(e["bytes"]).decode() == e["token"]
    text = b"".join(bytes(e["bytes"]) for e in entries).decode()
    assert text.strip() == body["choices"][0]["message"]["content"].strip()


def test_logprobs_without_top_logprobs_have_no_alternatives(client):
    entries = logprobs_of(client, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert entries and all(e["top_logprobs"] == [] for e in entries)


def test_no_logprobs_unless_asked(client):
    assert logprobs_of(client)["choices"][0]["logprobs"] is None


def test_streamed_logprobs_equal_the_non_streamed_ones(client, tiny_server):
    whole = logprobs_of(client, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    body = {"model": "m", "messages": HELLO, "temperature": 0, "max_tokens": 8, "stream": True, "logprobs": True, "top_logprobs": 2}
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = []
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c)
        if c["choices"][0]["logprobs"] is not None:
            streamed += c["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)


def test_logprobs_are_per_request_inside_a_batch(tiny_server):
    async def both():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as c:
            body = {"model": "m", "messages": HELLO, "temperature": 0, "max_tokens": 16}
            return await asyncio.gather(
                c.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 1}),
                c.post("/v1/chat/completions", json=body),
            )

    asked, not_asked = asyncio.run(both())
    assert len(asked.json()["choices"][0]["logprobs"]["content"]) == asked.json()["usage"]["completion_tokens"]
    assert not_asked.json()["choices"][0]["logprobs"] is None


def test_top_logprobs_over_20_is_a_400(client):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_logprobs"
