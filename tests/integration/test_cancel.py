"""Cancellation: a client disconnect and /v1/cancel (all or by id) free the engine; others are untouched."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}
LONG = 2000


def long_stream_body(max_tokens=LONG):
    return {"model": "m", "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "logit_bias": NO_EOS}


def finish_line(server, request_id, timeout=30) -> str:
    """The engine's log line for this request's end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = next((l for l in server.lines if l.startswith(f"[mlx] {request_id} ")), None)
        if line:
            return line
        time.sleep(0.05)
    raise AssertionError(f"no finish line for {request_id}")


def generated(line: str) -> int:
    return int(re.search(r"(\d+) generated", line).group(1))


def test_client_disconnect_cancels_its_generation(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        with c.stream("POST", CHAT, json=long_stream_body()) as r:
            frames = [json.loads(l[6:]) for _, l in zip(range(3), (l for l in r.iter_lines() if l.startswith("data: {")))]
    request_id = frames[0]["id"]
    line = finish_line(tiny_server, request_id)
    assert " cancelled:" in line
    assert generated(line) < 200  # far short of the 2000 it would have made


def test_cancel_all_ends_the_stream_and_the_next_request_runs(client):
    chunks = []
    with client.stream("POST", CHAT, json=long_stream_body()) as r:
        lines = r.iter_lines()
        chunks.append(next(l for l in lines if '"content"' in l))
        cancel = client.post("/v1/cancel", json={})
        rest = [l for l in lines if l.startswith("data: ")]
    assert cancel.json() == {"status": "cancelled", "cancelled_count": 1}
    assert rest[-1] == "data: [DONE]"
    final = json.loads(rest[-2][6:])
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["usage"]["completion_tokens"] < LONG
    after = client.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": NO_EOS})
    assert after.json()["usage"]["completion_tokens"] == 3
    assert client.post("/v1/cancel", json={}).json() == {"status": "no_active_generation", "cancelled_count": 0}


def test_cancel_with_empty_body_as_jan_sends_it(client):
    r = client.post("/v1/cancel", content=b"")
    assert r.json() == {"status": "no_active_generation", "cancelled_count": 0}


def test_cancel_non_streaming_by_disconnect(tiny_server):
    before = len(tiny_server.lines)
    body = {**long_stream_body(), "stream": False}
    with httpx.Client(base_url=tiny_server.url, timeout=1.0) as c:
        try:
            c.post(CHAT, json=body)
        except httpx.ReadTimeout:
            pass
    deadline = time.monotonic() + 30
    while not _new_finish(tiny_server, before) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = _new_finish(tiny_server, before)
    assert line, "the request never finished"
    assert " cancelled:" in line
    assert generated(line) < LONG


def _new_finish(server, before):
    return next((l for l in server.lines[before:] if l.startswith("[mlx] chatcmpl-")), None)


def test_cancel_by_id_stops_only_that_stream(tiny_server):
    results = {}

    def run(name, max_tokens):
        with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
            with c.stream("POST", CHAT, json=long_stream_body(max_tokens)) as r:
                frames = []
                for l in r.iter_lines():
                    if l.startswith("data: {"):
                        frames.append(json.loads(l[6:]))
                        results.setdefault(name + "_id", frames[0]["id"])
                results[name] = frames

    victim = threading.Thread(target=run, args=("victim", LONG))
    other = threading.Thread(target=run, args=("other", 40))
    victim.start()
    other.start()
    deadline = time.monotonic() + 60
    while "victim_id" not in results and time.monotonic() < deadline:
        time.sleep(0.05)
    r = httpx.post(tiny_server.url + "/v1/cancel", json={"id": results["victim_id"]})
    assert r.json() == {"status": "cancelled", "cancelled_count": 1}
    victim.join(60)
    other.join(60)
    assert results["victim"][-1]["usage"]["completion_tokens"] < LONG
    assert results["other"][-1]["choices"][0]["finish_reason"] == "length"
    assert results["other"][-1]["usage"]["completion_tokens"] == 40
