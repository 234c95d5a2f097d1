"""`make serve`'s server: no --model serves the embedded SmolLM2 GGUF, and it answers correctly."""

from __future__ import annotations

import httpx
import pytest

from conftest import ServerProcess


@pytest.fixture(scope="module")
def default_server():
    server = ServerProcess()  # no --model: the embedded default
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_default_model_knows_the_capital_of_france(default_server):
    body = {"model": "x", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 20}
    r = httpx.post(default_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_default_model_id_is_the_gguf_name(default_server):
    ids = [m["id"] for m in httpx.get(default_server.url + "/v1/models").json()["data"]]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1"]


def test_gguf_served_as_4bit_gives_the_same_greedy_answer(gguf_path, default_server):
    """The same GGUF with --dequantize off (MLX's quantized kernels) agrees on a short greedy answer."""
    server = ServerProcess("--model", str(gguf_path), "--dequantize", "off").wait_ready()
    try:
        body = {"model": "x", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 8}
        quantized = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        dequantized = httpx.post(default_server.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in quantized["choices"][0]["message"]["content"]
        assert quantized["choices"][0]["message"]["content"] == dequantized["choices"][0]["message"]["content"]
    finally:
        server.stop()


def test_mlx_directory_of_the_gguf_serves_the_same_greedy_tokens(gguf_path, default_server, tmp_path):
    from mlx_server.engine.gguf import export_mlx_dir

    export_mlx_dir(gguf_path, tmp_path / "smollm2")
    server = ServerProcess("--model", str(tmp_path / "smollm2")).wait_ready()
    try:
        body = {"model": "x", "messages": [{"role": "user", "content": "Name three fruits."}], "temperature": 0,
                "max_tokens": 24, "logit_bias": {"0": -100, "2": -100}}
        from_dir = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        from_gguf = httpx.post(default_server.url + "/v1/chat/completions", json=body, timeout=120).json()
        for key in ("prompt_tokens", "completion_tokens"):
            assert from_dir["usage"][key] == from_gguf["usage"][key]
        assert from_dir["choices"][0]["message"]["content"] == from_gguf["choices"][0]["message"]["content"]
    finally:
        server.stop()
