"""Prefix reuse: turn N of a chat prefills only what is new; the cache's byte cap always holds."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import ServerProcess

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}


def ask(client, messages, **fields):
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8, "logit_bias": NO_EOS, **fields}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def metric(client, name) -> float:
    text = client.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_turn_two_reuses_turn_one(client):
    turn1 = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea. " * 3}]
    first = ask(client, turn1)
    reply = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = ask(client, turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]
    assert second["timings"]["cache_n"] == cached
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached


def test_cached_answer_equals_uncached_answer(client):
    messages = [{"role": "user", "content": "Describe a mountain in winter, with snow and wind."}]
    cold = ask(client, messages, max_tokens=16)
    warm = ask(client, messages, max_tokens=16)  # the whole prompt is now cached
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_stream_cut_by_a_stop_string_still_feeds_the_cache(client):
    messages = [{"role": "user", "content": "List the planets of the solar system in order."}]
    reply = ask(client, messages, max_tokens=12)["choices"][0]["message"]["content"]
    stop = reply[len(reply) // 2 : len(reply) // 2 + 3]
    ask(client, messages, max_tokens=12, stop=stop)
    again = ask(client, messages, max_tokens=12)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def small_cache_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--prompt-cache-bytes", "2M").wait_ready()
    yield server
    server.stop()


def test_cache_bytes_never_exceed_the_cap(small_cache_server):
    with httpx.Client(base_url=small_cache_server.url, timeout=120) as c:
        cap = metric(c, "mlx_prompt_cache_limit_bytes")
        assert cap == 2 * 1024 * 1024
        seen = []
        for i in range(12):
            ask(c, [{"role": "user", "content": f"Conversation number {i}: " + "tell me about rivers and lakes. " * 12}])
            seen.append(metric(c, "mlx_prompt_cache_bytes"))
        assert max(seen) <= cap
        assert min(seen) > 0
        assert metric(c, "mlx_prompt_cache_entries") < 12  # older entries were evicted to honour the cap
