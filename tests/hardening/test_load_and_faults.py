"""About a minute of tens of concurrent clients mixing streaming and not, random disconnects,
/v1/cancel calls, malformed requests and oversized bodies. Afterwards: every well-formed request
got a complete and correct answer, nothing answered 5xx, /health answered throughout, and the
server's resident memory came back within a stated bound of its baseline."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import psutil
import pytest

from conftest import ServerProcess

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}
CLIENTS = 24
LOAD_SECONDS = 40
PROMPT_CACHE = 32 << 20
MLX_CACHE = 64 << 20
# Resident memory may exceed the warmed-up baseline by what the caps allow to stay resident
# (prefix cache, MLX buffer cache) plus 64 MiB for allocator slack: anything more is a leak.
RSS_SLACK = 64 << 20
RSS_BOUND = PROMPT_CACHE + MLX_CACHE + RSS_SLACK

PROMPTS = ["Tell me about the sea.", "What is a cat?", "Count to five.", "Name a color.",
           "Why is the sky blue?", "Describe a train."]
GREEDY = [{"model": "m", "messages": [{"role": "user", "content": p}], "temperature": 0, "logit_bias": NO_EOS,
           "max_tokens": 12 + 4 * i} for i, p in enumerate(PROMPTS)]
MALFORMED = [
    (b"{not json", 400),
    (json.dumps({"model": "m", "messages": "hi"}).encode(), 400),
    (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', 400),
    (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 2000}]}).encode(), 400),
]
OVERSIZED = b"{" + b" " * (11 * 1024 * 1024) + b"}"


@pytest.fixture(scope="module")
def load_server(tiny_model_dir):
    server = ServerProcess(
        "--model", str(tiny_model_dir), "--ctx-size", "512", "--max-concurrency", "8",
        "--prompt-cache-bytes", str(PROMPT_CACHE), "--cache-limit", str(MLX_CACHE),
    ).wait_ready()
    yield server
    server.stop()


class Outcomes:
    """What every client saw, collected across threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}
        self.wrong: list[str] = []
        self.counts: dict[str, int] = {}

    def saw(self, kind: str, status: int) -> None:
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def fail(self, detail: str) -> None:
        with self.lock:
            self.wrong.append(detail)


def read_stream(response: httpx.Response, stop_after: int | None = None, on_id=None) -> tuple[str, dict | None, bool]:
    """(content, final chunk, saw [DONE]); with stop_after, leaves after that many content chunks."""
    text, final, done = [], None, False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if on_id is not None:
                on_id(chunk["id"])
                on_id = None
            choice = chunk["choices"][0]
            if "content" in choice["delta"]:
                text.append(choice["delta"]["content"])
                if stop_after is not None and len(text) >= stop_after:
                    break
            if choice["finish_reason"]:
                final = chunk
    return "".join(text), final, done


def client_loop(url: str, seed: int, deadline: float, answers: dict[int, str], out: Outcomes) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as c:
        while time.monotonic() < deadline:
            roll = rng.random()
            i = rng.randrange(len(GREEDY))
            body = GREEDY[i]
            try:
                if roll < 0.30:
                    r = c.post(CHAT, json=body)
                    out.saw("greedy", r.status_code)
                    got = r.json()
                    if r.status_code != 200 or got["choices"][0]["message"]["content"] != answers[i] \
                            or got["usage"]["completion_tokens"] != body["max_tokens"]:
                        out.fail(f"greedy {i}: {r.status_code} {r.text[:200]}")
                elif roll < 0.60:
                    with c.stream("POST", CHAT, json={**body, "stream": True}) as r:
                        out.saw("greedy stream", r.status_code)
                        text, final, done = read_stream(r)
                    if text != answers[i] or not done or final["choices"][0]["finish_reason"] != "length":
                        out.fail(f"greedy stream {i}: {text!r} done={done}")
                elif roll < 0.70:
                    sampled = {**body, "temperature": 0.9, "seed": rng.randrange(1 << 30), "stream": True}
                    with c.stream("POST", CHAT, json=sampled) as r:
                        out.saw("sampled stream", r.status_code)
                        _, final, done = read_stream(r)
                    if not done or final["usage"]["completion_tokens"] != body["max_tokens"]:
                        out.fail(f"sampled stream {i}: done={done} final={final}")
                elif roll < 0.80:
                    with c.stream("POST", CHAT, json={**body, "max_tokens": 400, "stream": True}) as r:
                        out.saw("disconnect", r.status_code)
                        read_stream(r, stop_after=rng.randrange(1, 6))
                elif roll < 0.87:
                    ids = []
                    with c.stream("POST", CHAT, json={**body, "stream": True}) as r:
                        out.saw("cancelled stream", r.status_code)
                        text, final, done = read_stream(r, on_id=lambda rid: ids.append(c.post("/v1/cancel", json={"id": rid})))
                    cancel = ids[0]
                    out.saw("cancel", cancel.status_code)
                    cancelled = cancel.json()["cancelled_count"] == 1
                    if not done or not answers[i].startswith(text) or (not cancelled and text != answers[i]):
                        out.fail(f"cancelled stream {i}: {text!r} cancelled={cancelled} done={done}")
                elif roll < 0.95:
                    payload, status = rng.choice(MALFORMED)
                    r = c.post(CHAT, content=payload, headers={"content-type": "application/json"})
                    out.saw("malformed", r.status_code)
                    if r.status_code != status or "error" not in r.json():
                        out.fail(f"malformed: {r.status_code} {r.text[:200]}")
                elif roll < 0.98:
                    r = c.post(CHAT, content=OVERSIZED, headers={"content-type": "application/json"})
                    out.saw("oversized", r.status_code)
                    if r.status_code != 413:
                        out.fail(f"oversized: {r.status_code}")
                else:
                    r = c.post("/v1/cancel", json={"id": "chatcmpl-unknown"})
                    out.saw("cancel unknown", r.status_code)
                    if r.json() != {"status": "no_active_generation", "cancelled_count": 0}:
                        out.fail(f"cancel unknown: {r.text}")
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
                out.fail(f"{type(e).__name__}: {e}")


def health_loop(url: str, stop: threading.Event, out: Outcomes) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            try:
                r = c.get("/health")
                out.saw("health", r.status_code)
                if r.json() != {"status": "ok"}:
                    out.fail(f"health: {r.text}")
            except httpx.HTTPError as e:
                out.fail(f"health: {type(e).__name__}")
            stop.wait(0.25)


def run_load(url: str, seconds: float, answers: dict[int, str], seed: int) -> Outcomes:
    out, stop = Outcomes(), threading.Event()
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=client_loop, args=(url, seed + n, deadline, answers, out)) for n in range(CLIENTS)]
    health = threading.Thread(target=health_loop, args=(url, stop, out))
    health.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    health.join(30)
    return out


def settle(url: str) -> None:
    """Wait until the engine holds no generation (disconnected streams end at their next token)."""
    for _ in range(600):
        metrics = httpx.get(url + "/metrics").text
        if "\nmlx_active_sequences 0.0\n" in metrics and "\nmlx_queue_depth 0.0\n" in metrics:
            return
        time.sleep(0.1)
    raise AssertionError("generations still live after the load")


def test_load_with_faults_loses_no_answer_and_returns_memory(load_server):
    url = load_server.url
    answers = {i: httpx.post(url + CHAT, json=b, timeout=120).json()["choices"][0]["message"]["content"] for i, b in enumerate(GREEDY)}
    warm = run_load(url, 8, answers, seed=1000)  # fills the caps and allocator pools first
    assert warm.wrong == []
    settle(url)
    process = psutil.Process(load_server.proc.pid)
    baseline = process.memory_info().rss

    out = run_load(url, LOAD_SECONDS, answers, seed=1)
    settle(url)
    after = process.memory_info().rss
    health = httpx.get(url + "/health", timeout=10)

    print(f"\nload: {sum(out.counts.values())} requests {out.counts}, statuses {out.statuses}; "
          f"RSS baseline {baseline >> 20} MiB, after {after >> 20} MiB (bound +{RSS_BOUND >> 20} MiB)")
    assert out.wrong == []
    assert not any(status >= 500 for status in out.statuses)
    assert 429 not in out.statuses
    assert min(out.counts.get(kind, 0) for kind in ("greedy", "greedy stream", "disconnect", "cancelled stream", "malformed", "oversized")) > 0
    assert health.json() == {"status": "ok"}
    assert after <= baseline + RSS_BOUND, f"RSS grew from {baseline >> 20} to {after >> 20} MiB"
    assert not any("Traceback" in line or "unexpected error" in line for line in load_server.lines)
