"""The process contract Jan relies on (SPEC §1): start-up lines, model id, auth, SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess
from openai_schema import assert_valid

KEY = "sekret-key"


@pytest.fixture(scope="module")
def jan_server(tiny_model_dir):
    """Started exactly as Jan starts it, with MLX_API_KEY in the environment as Jan sets it."""
    server = ServerProcess(
        "--model", str(tiny_model_dir), "--model-id", "jan-model", "--ctx-size", "4096", "--api-key", KEY,
        env={"MLX_API_KEY": KEY},
    )
    line = server.wait_for_line("http server listening")
    # The line must not come before the socket answers: /health works the moment we read it.
    health = httpx.get(server.url + "/health", timeout=2)
    yield server, line, health
    server.stop()


def test_readiness_lines_come_after_health_answers(jan_server):
    server, line, health = jan_server
    assert health.status_code == 200
    assert line == f"[mlx] http server listening on http://127.0.0.1:{server.port}"
    server.wait_for_line("server is listening on", timeout=5)
    assert all(l.startswith("[mlx] ") for l in server.lines)
    lines = server.lines
    assert lines.index(line) < lines.index(f"[mlx] server is listening on 127.0.0.1:{server.port}")


def test_models_reports_the_given_model_id(jan_server):
    server, *_ = jan_server
    body = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in body["data"]] == ["jan-model"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/cancel")])
def test_missing_or_wrong_key_is_401(jan_server, headers, method, path):
    server, *_ = jan_server
    r = httpx.request(method, server.url + path, headers=headers, json={})
    assert r.status_code == 401
    assert r.json() == {"error": {"message": "Unauthorized", "type": "authentication_error", "code": "unauthorized", "param": None}}
    assert_valid("ErrorResponse", r.json())


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_bearer_and_x_api_key_both_work(jan_server, headers):
    server, *_ = jan_server
    body = {"model": "jan-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_health_needs_no_key(jan_server):
    server, *_ = jan_server
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_env_key_is_the_fallback_for_api_key(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), env={"MLX_API_KEY": "from-env"}).wait_ready()
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "from-env"}).status_code == 200
    finally:
        server.stop()


def test_model_id_defaults_to_the_last_path_component(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir / "config.json")).wait_ready()
    try:
        ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert ids == ["config"]  # a file inside the model directory: its name without .json
    finally:
        server.stop()


def test_missing_model_path_exits_nonzero_before_any_readiness_line(tmp_path):
    server = ServerProcess("--model", str(tmp_path / "nope"))
    code = server.proc.wait(60)
    time.sleep(0.2)
    assert code != 0
    assert not any("listening" in l for l in server.all_lines())
    assert "does not exist" in server.proc.stderr.read()


def test_directory_without_a_model_exits_nonzero(tmp_path):
    server = ServerProcess("--model", str(tmp_path))
    assert server.proc.wait(60) != 0
    assert "config.json" in server.proc.stderr.read()


def test_port_in_use_exits_nonzero_without_readiness(tiny_server, tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), port=tiny_server.port)
    assert server.proc.wait(60) != 0
    assert not any("http server listening" in l for l in server.all_lines())


def test_sigterm_during_a_stream_exits_zero_within_two_seconds(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir)).wait_ready()
    got_chunk = threading.Event()

    def stream():
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1000, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for _ in r.iter_lines():
                    got_chunk.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert got_chunk.wait(60)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(10)
    elapsed = time.monotonic() - start
    assert code == 0
    assert elapsed < 2.0, f"exit took {elapsed:.2f}s"
    t.join(5)
