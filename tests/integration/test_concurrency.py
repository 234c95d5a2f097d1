"""Continuous batching: mixed concurrent streams each get their own correct answer; cancelling one
(by disconnect or by id) leaves the others complete and correct."""

from __future__ import annotations

import json
import threading

import httpx

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}
PROMPTS = [
    "Tell me about the sea.", "What is a cat?", "Count to five.", "Name a color.",
    "Why is the sky blue?", "Write a short poem.", "What is bread made of?", "Describe a train.",
]


def stream(url, body, out, key, stop_after=None):
    """Streams one request; with stop_after, disconnects after that many content chunks."""
    text, final, rid = [], None, None
    with httpx.Client(base_url=url, timeout=300) as c:
        with c.stream("POST", CHAT, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                out[key + "_id"] = rid
                delta = chunk["choices"][0]["delta"]
                if "content" in delta:
                    text.append(delta["content"])
                    if stop_after is not None and len(text) >= stop_after:
                        break
                if chunk["choices"][0]["finish_reason"]:
                    final = chunk
    out[key] = ("".join(text), final)


def body_for(i, **fields):
    return {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i]}], "logit_bias": NO_EOS, **fields}


def run_all(url, bodies, stop_after=None):
    out = {}
    threads = [threading.Thread(target=stream, args=(url, b, out, str(i), (stop_after or {}).get(i))) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_eight_mixed_concurrent_streams_match_their_sequential_answers(tiny_server):
    bodies = [
        body_for(0, temperature=0, max_tokens=20),
        body_for(1, temperature=0, max_tokens=12),
        body_for(2, temperature=0.9, max_tokens=15, seed=3),
        body_for(3, temperature=0, max_tokens=25, stop=["\n\n"]),
        body_for(4, temperature=1.2, top_p=0.9, max_tokens=10, seed=5),
        body_for(5, temperature=0, max_tokens=30, repetition_penalty=1.3),
        body_for(6, temperature=0.5, top_k=20, max_tokens=18, seed=9),
        body_for(7, temperature=0, max_tokens=8, stop="zz"),
    ]
    sequential = {str(i): None for i in range(len(bodies))}
    for i, b in enumerate(bodies):
        stream(tiny_server.url, b, sequential, str(i))
    concurrent = run_all(tiny_server.url, bodies)
    for i, b in enumerate(bodies):
        text, final = concurrent[str(i)]
        assert final is not None, f"stream {i} did not finish"
        if b.get("stop") is None:
            assert final["choices"][0]["finish_reason"] == "length"
            assert final["usage"]["completion_tokens"] == b["max_tokens"]
        if b["temperature"] == 0:
            assert text == sequential[str(i)][0], f"greedy stream {i} differs when batched"
        for s in [b["stop"]] if isinstance(b.get("stop"), str) else b.get("stop") or []:
            assert s not in text


def test_gpu_decode_step_variants_give_the_same_answers_batched(tiny_server, tiny_model_dir):
    """What GPUs run by default (fused projections, compiled decode steps), forced on here: the 8
    mixed streams, concurrent, give the greedy answers the default (CPU) server gives one by one."""
    from conftest import ServerProcess

    bodies = [body_for(i, temperature=0, max_tokens=8 + 3 * i) for i in range(8)]
    sequential = {}
    for i, b in enumerate(bodies):
        stream(tiny_server.url, b, sequential, str(i))
    server = ServerProcess("--model", str(tiny_model_dir), "--ctx-size", "1024",
                           "--fuse-projections", "on", "--compile-decode", "on").wait_ready()
    try:
        concurrent = run_all(server.url, bodies)
    finally:
        server.stop()
    log = server.stderr() + "\n".join(server.all_lines())
    assert "fused projections: q/k/v and gate/up joined in 2 of 2 layers" in log
    assert "compiled decode steps in 2 of 2 layers" in log
    for i, b in enumerate(bodies):
        text, final = concurrent[str(i)]
        assert final["usage"]["completion_tokens"] == b["max_tokens"]
        assert text == sequential[str(i)][0], f"stream {i} differs"


def test_cancelling_one_of_four_leaves_the_other_three_correct(tiny_server):
    bodies = [body_for(i, temperature=0, max_tokens=30) for i in range(4)]
    alone = {}
    for i in (1, 2, 3):
        stream(tiny_server.url, bodies[i], alone, str(i))
    bodies[0]["max_tokens"] = 2000
    together = run_all(tiny_server.url, bodies, stop_after={0: 3})  # stream 0 disconnects
    assert together["0"][1] is None
    for i in (1, 2, 3):
        assert together[str(i)][0] == alone[str(i)][0]
        assert together[str(i)][1]["usage"]["completion_tokens"] == 30


def test_cancelling_one_of_four_by_id_leaves_the_other_three_correct(tiny_server):
    bodies = [body_for(i, temperature=0, max_tokens=30) for i in range(4)]
    alone = {}
    for i in (1, 2, 3):
        stream(tiny_server.url, bodies[i], alone, str(i))
    bodies[0]["max_tokens"] = 2000
    out = {}
    threads = [threading.Thread(target=stream, args=(tiny_server.url, b, out, str(i))) for i, b in enumerate(bodies)]
    threads[0].start()
    while "0_id" not in out:
        threads[0].join(0.05)
    for t in threads[1:]:
        t.start()
    r = httpx.post(tiny_server.url + "/v1/cancel", json={"id": out["0_id"]})
    assert r.json() == {"status": "cancelled", "cancelled_count": 1}
    for t in threads:
        t.join(300)
    assert out["0"][1]["usage"]["completion_tokens"] < 2000
    for i in (1, 2, 3):
        assert out[str(i)][0] == alone[str(i)][0]
        assert out[str(i)][1]["choices"][0]["finish_reason"] == "length"


def test_a_full_queue_is_a_429_in_openai_shape(tiny_model_dir):
    from conftest import ServerProcess

    server = ServerProcess("--model", str(tiny_model_dir), "--max-concurrency", "1", "--max-queue", "0").wait_ready()
    try:
        out = {}
        t = threading.Thread(target=stream, args=(server.url, body_for(0, max_tokens=2000), out, "long"))
        t.start()
        while "long_id" not in out:
            t.join(0.05)
        r = httpx.post(server.url + CHAT, json=body_for(1, max_tokens=2))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "server_busy"
        httpx.post(server.url + "/v1/cancel", json={})
        t.join(60)
        assert httpx.post(server.url + CHAT, json=body_for(1, max_tokens=2)).status_code == 200
    finally:
        server.stop()
