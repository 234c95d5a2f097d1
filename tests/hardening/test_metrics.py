"""/metrics in Prometheus format: requests by route and status, latency histograms, token and
cache counters, queue depth and live sequences, all moving with traffic; off or behind the key."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerProcess

CHAT = "/v1/chat/completions"
NO_EOS = {"0": -100, "2": -100}


def scrape(client) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape."""
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ask(client, content, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6, "logit_bias": NO_EOS, **fields}
    return client.post(CHAT, json=body)


def test_metrics_expose_every_series_the_issue_names(client):
    ask(client, "Name a color.")
    names = {name for name, _ in scrape(client)}
    for series in (
        "mlx_http_requests_total", "mlx_time_to_first_token_seconds_bucket", "mlx_time_per_output_token_seconds_bucket",
        "mlx_prompt_tokens_total", "mlx_generated_tokens_total", "mlx_prompt_cache_hit_tokens_total",
        "mlx_prompt_cache_lookups_total", "mlx_prompt_cache_bytes", "mlx_queue_depth", "mlx_active_sequences",
        "mlx_kv_cache_reserved_tokens", "mlx_memory_active_bytes", "process_resident_memory_bytes",
    ):
        assert series in names, series


def test_request_token_latency_and_cache_metrics_move_with_traffic(client):
    before = scrape(client)
    first = ask(client, "Metrics: tell me about the mountains.").json()
    with client.stream("POST", CHAT, json={"model": "m", "stream": True, "temperature": 0, "max_tokens": 6, "logit_bias": NO_EOS,
                                          "messages": [{"role": "user", "content": "Metrics: tell me about the mountains."}]}) as r:
        final = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")][-1]
    assert ask(client, "x", temperature="hot").status_code == 400
    after = scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/chat/completions"
    assert delta("mlx_http_requests_total", route=route, status="200") == 2
    assert delta("mlx_http_requests_total", route=route, status="400") == 1
    assert delta("mlx_time_to_first_token_seconds_count") == 2
    assert delta("mlx_time_per_output_token_seconds_count") == 2
    assert delta("mlx_prompt_tokens_total") == first["usage"]["prompt_tokens"] + final["usage"]["prompt_tokens"]
    assert delta("mlx_generated_tokens_total") == 12
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (first["usage"], final["usage"])]
    assert cached[1] > 0  # the second sends the first's prompt again
    assert delta("mlx_prompt_cache_hit_tokens_total") == sum(cached)
    assert delta("mlx_prompt_cache_lookups_total", result="hit") == sum(1 for c in cached if c)
    assert delta("mlx_generations_total", reason="length") == 2
    assert value(after, "mlx_prompt_cache_bytes") > 0


def test_active_sequences_count_live_generations(client, tiny_server):
    started = [threading.Event(), threading.Event()]

    def long_stream(event):
        body = {"model": "m", "stream": True, "max_tokens": 2000, "logit_bias": NO_EOS, "messages": [{"role": "user", "content": "Go on."}]}
        with httpx.stream("POST", tiny_server.url + CHAT, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    event.set()

    threads = [threading.Thread(target=long_stream, args=(e,)) for e in started]
    for t in threads:
        t.start()
    for e in started:
        e.wait(60)
    during = scrape(client)
    client.post("/v1/cancel", json={})
    for t in threads:
        t.join(60)
    assert value(during, "mlx_active_sequences") == 2
    assert value(during, "mlx_kv_cache_reserved_tokens") > 0


def test_unknown_paths_share_one_series(client):
    client.get("/no/such/path/123")
    routes = {dict(labels).get("route") for name, labels in scrape(client) if name == "mlx_http_requests_total"}
    assert "unmatched" in routes
    assert not any(r and r.startswith("/no/") for r in routes)


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--api-key", "k").wait_ready()
    yield server
    server.stop()


def test_metrics_need_the_key_when_one_is_set(keyed_server):
    assert httpx.get(keyed_server.url + "/metrics").status_code == 401
    assert httpx.get(keyed_server.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_refusals_before_routing_are_counted_under_their_route(keyed_server):
    httpx.post(keyed_server.url + CHAT, json={})
    samples = scrape(httpx.Client(base_url=keyed_server.url, headers={"x-api-key": "k"}))
    assert value(samples, "mlx_http_requests_total", route="/v1/chat/completions", status="401") == 1


def test_metrics_off_removes_the_route(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--metrics", "off").wait_ready()
    try:
        assert httpx.get(server.url + "/metrics").status_code == 404
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        server.stop()
