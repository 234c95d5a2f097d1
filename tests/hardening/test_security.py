"""Security: CORS off unless origins are listed, a loud warning off loopback without a key,
no paths or internals in error bodies, and bounds on everything a request may ask for."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import ServerProcess
from mlx_server.api.limits import MAX_CONTENT_PARTS, MAX_JSON_DEPTH, MAX_MESSAGES, MAX_TOOLS, MAX_TOOLS_JSON_BYTES
from mlx_server.engine.scheduler import public_error
from openai_schema import assert_valid

CHAT = "/v1/chat/completions"
ORIGIN = "http://localhost:1420"


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "description": "", "parameters": parameters or {"type": "object", "properties": {}}}}


def nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# (name, body, text the message must contain, param)
LIMITS = [
    ("too many messages", chat(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)), f"at most {MAX_MESSAGES} messages", "messages"),
    ("too many content parts", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)}]),
     f"at most {MAX_CONTENT_PARTS} content parts", "messages[0].content"),
    ("too many tools", chat(tools=[tool(f"f{i}") for i in range(MAX_TOOLS + 1)]), f"at most {MAX_TOOLS} tools", "tools"),
    ("tool schemas too large", chat(tools=[tool(parameters={"type": "object", "description": "x" * MAX_TOOLS_JSON_BYTES})]), "bytes of JSON", "tools"),
    ("tool schema nested too deep", chat(tools=[tool(parameters=nested(MAX_JSON_DEPTH))]), "levels deep", "tools"),
    ("template kwargs replace the template", chat(chat_template_kwargs={"chat_template": "{% for i in range(99999) %}{% endfor %}"}),
     "reserved", "chat_template_kwargs.chat_template"),
    ("template kwargs change what rendering returns", chat(chat_template_kwargs={"tokenize": True}), "reserved", "chat_template_kwargs.tokenize"),
    ("too many stop strings", chat(stop=[f"s{i}" for i in range(17)]), "at most 16 stop strings", "stop"),
    ("stop string too long", chat(stop=["x" * 513]), "at most 512 characters", "stop"),
]


@pytest.mark.parametrize("name,body,needle,param", LIMITS, ids=[c[0] for c in LIMITS])
def test_request_beyond_a_limit_is_a_400_naming_the_field(client, name, body, needle, param):
    r = client.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert_valid("ErrorResponse", r.json())
    assert needle in error["message"] and error["param"] == param


def test_lone_surrogate_in_the_body_is_a_400(client):
    r = client.post(CHAT, content=b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "unpaired UTF-16 surrogate" in r.json()["error"]["message"]


def test_escaped_surrogate_pairs_are_fine(client):
    r = client.post(CHAT, content=b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_seeds_of_any_size_or_sign_are_accepted(client):
    for seed in (-1, 2**64 + 5, -(2**70)):
        assert client.post(CHAT, json=chat(seed=seed, temperature=0.8)).status_code == 200


def test_sampling_values_past_the_vocabulary_or_context_still_generate(client):
    r = client.post(CHAT, json=chat(top_k=10**12, repeat_last_n=10**12, repeat_penalty=1.1, temperature=0.8))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_cors_is_off_by_default(client):
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers
    preflight = client.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


@pytest.fixture(scope="module")
def cors_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--cors-origins", f"{ORIGIN}, http://app.test", "--api-key", "k").wait_ready()
    yield server
    server.stop()


def test_listed_origins_pass_preflight_without_the_key(cors_server):
    r = httpx.options(cors_server.url + CHAT, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_listed_origins_still_need_the_key(cors_server):
    assert httpx.get(cors_server.url + "/v1/models", headers={"Origin": ORIGIN}).status_code == 401
    r = httpx.get(cors_server.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_unlisted_origins_get_no_cors_headers(cors_server):
    r = httpx.options(cors_server.url + CHAT, headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(cors_server.url + "/v1/models", headers={"Origin": "http://evil.test", "Authorization": "Bearer k"})
    assert "access-control-allow-origin" not in r.headers


def test_binding_beyond_loopback_without_a_key_warns_loudly(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--host", "0.0.0.0").wait_ready()
    try:
        assert any("WARNING: listening on 0.0.0.0 without an API key" in line for line in server.lines)
    finally:
        server.stop()


def test_unexpected_errors_answer_500_without_paths_or_details(idle_engine, tiny_model_dir):
    from mlx_server.api.app import create_app
    from mlx_server.config import Settings

    app = create_app(idle_engine, Settings(model_id="m", metrics=False))

    @app.get("/v1/boom")
    async def boom():
        raise FileNotFoundError(f"{tiny_model_dir}/secret.safetensors")

    r = TestClient(app, raise_server_exceptions=False).get("/v1/boom")
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal server error"
    assert str(tiny_model_dir) not in r.text


def test_engine_failures_reach_clients_without_paths():
    leaked = "/Users/someone/models/Qwen3-4B/model.safetensors"
    assert leaked not in public_error("generation failed", RuntimeError(f"[load] cannot read {leaked}"))
    assert "out of memory" in public_error("generation failed", RuntimeError("[metal::malloc] Unable to allocate 1073741824 bytes"))
