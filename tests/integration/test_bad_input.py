"""Every kind of bad input gets the right status and an OpenAI error body; the server keeps serving."""

from __future__ import annotations

import pytest

from openai_schema import assert_valid

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "m", "messages": OK_MESSAGES, **fields}


# (name, method, path, kwargs for httpx, expected status, text the message must contain, expected param)
CASES = [
    ("invalid json", "POST", CHAT, {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON", None),
    ("empty body", "POST", CHAT, {"content": b"", "headers": {"content-type": "application/json"}}, 400, "", None),
    ("body is a list", "POST", CHAT, {"json": [1, 2]}, 400, "request body", None),
    ("missing messages", "POST", CHAT, {"json": {"model": "m"}}, 400, "messages", "messages"),
    ("missing model", "POST", CHAT, {"json": {"messages": OK_MESSAGES}}, 400, "model", "model"),
    ("empty messages", "POST", CHAT, {"json": chat(messages=[])}, 400, "messages", "messages"),
    ("messages not a list", "POST", CHAT, {"json": chat(messages="hi")}, 400, "messages", "messages"),
    ("unknown role", "POST", CHAT, {"json": chat(messages=[{"role": "wizard", "content": "x"}])}, 400, "role", "messages[0].role"),
    ("message without role", "POST", CHAT, {"json": chat(messages=[{"content": "x"}])}, 400, "role", "messages[0].role"),
    ("content wrong type", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": 42}])}, 400, "content", "messages[0].content"),
    ("unknown content part type", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}])}, 400, "hologram", "messages[0].content[0]"),
    ("text part without text", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": [{"type": "text"}]}])}, 400, "text", "messages[0].content[0].text"),
    ("image to text-only model", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///tmp/x.png"}}]}])}, 400, "text-only", "messages[0].content[0]"),
    ("images array to text-only model", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": "x", "images": ["file:///tmp/x.png"]}])}, 400, "images", "messages[0].images"),
    ("negative max_tokens", "POST", CHAT, {"json": chat(max_tokens=-5)}, 400, "max_tokens", "max_tokens"),
    ("zero max_tokens", "POST", CHAT, {"json": chat(max_tokens=0)}, 400, "max_tokens", "max_tokens"),
    ("max_tokens a string", "POST", CHAT, {"json": chat(max_tokens="ten")}, 400, "max_tokens", "max_tokens"),
    ("temperature -1", "POST", CHAT, {"json": chat(temperature=-1)}, 400, "temperature", "temperature"),
    ("temperature a string", "POST", CHAT, {"json": chat(temperature="hot")}, 400, "temperature", "temperature"),
    ("top_p above 1", "POST", CHAT, {"json": chat(top_p=1.5)}, 400, "top_p", "top_p"),
    ("stream not a bool", "POST", CHAT, {"json": chat(stream="yes")}, 400, "stream", "stream"),
    ("stop wrong type", "POST", CHAT, {"json": chat(stop=5)}, 400, "stop", "stop"),
    ("too many stop strings", "POST", CHAT, {"json": chat(stop=[f"s{i}" for i in range(40)])}, 400, "stop", "stop"),
    ("n greater than 1", "POST", CHAT, {"json": chat(n=3)}, 400, "n", "n"),
    ("logit_bias unknown token", "POST", CHAT, {"json": chat(logit_bias={"99999999": 5})}, 400, "logit_bias", "logit_bias"),
    ("logit_bias out of range", "POST", CHAT, {"json": chat(logit_bias={"5": 500})}, 400, "logit_bias", "logit_bias.5"),
    ("oversized prompt", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": "word " * 3000}])}, 400, "1024", "messages"),
    ("11 MiB body", "POST", CHAT, {"content": b"{" + b" " * (11 * 1024 * 1024) + b"}", "headers": {"content-type": "application/json"}}, 413, "10 MiB", None),
    ("unknown route", "GET", "/v1/nothing", {}, 404, "/v1/nothing", None),
    ("wrong method", "GET", CHAT, {}, 405, "GET", None),
    ("cancel with bad json", "POST", "/v1/cancel", {"content": b"{oops"}, 400, "JSON", None),
    ("cancel with non-string id", "POST", "/v1/cancel", {"json": {"id": 7}}, 400, "id", "id"),
    ("unknown model id", "GET", "/v1/models/other", {}, 404, "other", "model"),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,needle,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_clear_error(client, name, method, path, kwargs, status, needle, param):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert_valid("ErrorResponse", body)
    assert needle.lower() in body["error"]["message"].lower(), body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert client.get("/health").json() == {"status": "ok"}


def test_context_overflow_has_its_code_and_both_numbers(client):
    r = client.post(CHAT, json=chat(messages=[{"role": "user", "content": "word " * 3000}]))
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "1024" in error["message"]
    assert str(3000) in error["message"] or any(str(n) in error["message"] for n in range(3000, 3100))


def test_server_still_generates_after_all_bad_inputs(client):
    for _, method, path, kwargs, *_ in CASES:
        client.request(method, path, **kwargs)
    r = client.post(CHAT, json=chat(max_tokens=3))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3


def test_null_optional_fields_mean_defaults(client):
    nulls = {k: None for k in ("temperature", "top_p", "max_tokens", "stop", "stream", "seed", "n", "logit_bias",
                               "presence_penalty", "frequency_penalty", "stream_options", "top_k", "min_p")}
    # n_predict (llama.cpp's name) bounds the answer, so a null max_tokens cannot run to the window's end.
    r = client.post(CHAT, json=chat(**nulls, n_predict=3))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
