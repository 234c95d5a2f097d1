"""Memory caps: MLX's allocator limits by flag, and a KV-cache budget under which requests wait,
completions end with `length`, and a prompt that can never fit is a clear 400, while every
other stream completes."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import httpx
import mlx.core as mx
import pytest

from conftest import ServerProcess
from mlx_server.engine.memory import batch_fits, kv_bytes_per_token, plan_memory

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}
KV_TOKENS = 192  # --kv-cache-limit 576K at the tiny model's 3072 bytes per token (float32)


def ask(messages_text: str, **fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": messages_text}], "temperature": 0, "logit_bias": NO_EOS, **fields}


@pytest.fixture(scope="module")
def capped_server(tiny_model_dir):
    server = ServerProcess(
        "--model", str(tiny_model_dir), "--ctx-size", "1024", "--kv-cache-limit", "576K",
        "--memory-limit", "4G", "--cache-limit", "64M", "--prompt-cache-bytes", "0",
    ).wait_ready()
    yield server
    server.stop()


def metric(url: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def stream_text(url: str, body: dict, out: dict, key: str, started: threading.Event | None = None) -> None:
    text, final = [], None
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    text.append(chunk["choices"][0]["delta"]["content"])
                    if started is not None:
                        started.set()
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    final = chunk
    out[key] = ("".join(text), final)


def test_memory_flags_set_mlx_limits_and_the_kv_budget_is_logged(capped_server):
    line = next(l for l in capped_server.lines if "Memory:" in l)
    assert "limit 4.0 GiB" in line and "MLX buffer cache 64.0 MiB" in line
    assert f"KV cache 576.0 KiB ({KV_TOKENS} tokens)" in line
    assert any("less than --ctx-size 1024" in l for l in capped_server.lines)


def test_a_prompt_larger_than_the_kv_cap_is_a_clear_400_while_other_streams_complete(capped_server):
    out, started = {}, [threading.Event(), threading.Event()]
    bodies = [ask("Tell me about the sea.", max_tokens=50), ask("What is a cat?", max_tokens=50)]
    threads = [threading.Thread(target=stream_text, args=(capped_server.url, b, out, str(i), started[i])) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(60)
    r = httpx.post(capped_server.url + CHAT, json=ask("word " * 200, max_tokens=5), timeout=60)
    for t in threads:
        t.join(120)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"holds {KV_TOKENS} tokens" in error["message"] and "--kv-cache-limit" in error["message"]
    for i in range(2):
        text, final = out[str(i)]
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == 50


def test_a_completion_that_would_outgrow_the_kv_cap_finishes_with_length(capped_server):
    r = httpx.post(capped_server.url + CHAT, json=ask("Go on forever."), timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == KV_TOKENS


def test_requests_beyond_the_kv_cap_wait_their_turn_and_all_complete(capped_server):
    # Each needs ~75 tokens: two fit in the budget together (batch-padded), the third waits.
    prompts = ["Tell me about the sea.", "What is a cat?", "Name a color."]
    alone = {}
    for i, p in enumerate(prompts):
        stream_text(capped_server.url, ask(p, max_tokens=40), alone, str(i))
    out, peak = {}, {"reserved": 0.0, "queued": 0.0}
    threads = [threading.Thread(target=stream_text, args=(capped_server.url, ask(p, max_tokens=40), out, str(i))) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak["reserved"] = max(peak["reserved"], metric(capped_server.url, "mlx_kv_cache_reserved_tokens"))
        peak["queued"] = max(peak["queued"], metric(capped_server.url, "mlx_queue_depth"))
        time.sleep(0.05)
    assert 0 < peak["reserved"] <= KV_TOKENS
    assert peak["queued"] > 0
    for i in range(len(prompts)):
        assert out[str(i)][0] == alone[str(i)][0]
        assert out[str(i)][1]["usage"]["completion_tokens"] == 40


def test_batch_cost_is_its_size_times_its_longest_sequence():
    assert batch_fits([100, 100], 200)
    assert not batch_fits([100, 101], 200)
    assert not batch_fits([10, 10, 150], 200)  # padded to 150 each: 450
    assert batch_fits([500], 0)  # 0: no cap


def fake_model(layers: int, heads: int, kv_heads: int, head_dim: int, dtype, n_weights: int = 2):
    return SimpleNamespace(
        args=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim),
        layers=[None] * layers,
        parameters=lambda: {"w": mx.zeros((n_weights,), dtype=dtype)},
    )


def test_kv_bytes_per_token_come_from_the_model_config():
    # Llama-3-8B's shape: 32 layers, 8 KV heads of 128, bfloat16: keys and values.
    assert kv_bytes_per_token(fake_model(32, 32, 8, 128, mx.bfloat16)) == 2 * 32 * 8 * 128 * 2


def test_default_kv_budget_is_three_quarters_of_what_weights_and_caches_leave():
    model = fake_model(2, 4, 4, 16, mx.float16, n_weights=1 << 20)  # 2 MiB of weights, 512 B per token
    plan = plan_memory(model, ctx_size=4096, prompt_cache_bytes=1 << 30, memory_limit=16 << 30)
    assert plan.cache_limit == 1 << 30
    assert plan.kv_limit == int(((16 << 30) - (2 << 20) - (1 << 30) - (1 << 30)) * 0.75)


def test_default_kv_budget_always_holds_one_full_context():
    model = fake_model(2, 4, 4, 16, mx.float16, n_weights=1 << 20)
    assert plan_memory(model, ctx_size=4096, prompt_cache_bytes=0, memory_limit=1 << 20).kv_tokens == 4096


def test_the_prefix_cache_holds_no_more_memory_than_its_cap(tiny_model_dir):
    # A cache taken out of a batch used to pin the whole batch's KV buffers while counting one row.
    server = ServerProcess("--model", str(tiny_model_dir), "--prompt-cache-bytes", "2M", "--max-concurrency", "8").wait_ready()
    try:
        baseline = metric(server.url, "mlx_memory_active_bytes")
        for round in range(3):
            out = {}
            threads = [threading.Thread(target=stream_text, args=(server.url, ask(f"Round {round}, question {i}: why is the sky blue?", max_tokens=8), out, str(i)))
                       for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert all(final["usage"]["completion_tokens"] == 8 for _, final in out.values())
        assert 0 < metric(server.url, "mlx_prompt_cache_bytes") <= 2 << 20
        # The cap, plus 2 MiB for what MLX keeps besides (pinned batches made this ~20 MiB).
        assert metric(server.url, "mlx_memory_active_bytes") - baseline <= (2 << 20) + (2 << 20)
    finally:
        server.stop()
