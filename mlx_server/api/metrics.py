"""GET /metrics in Prometheus text format (prometheus-client), from the engine's live state."""

from __future__ import annotations

import mlx.core as mx
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # the `_created` series only double what a scrape shows

router = APIRouter()


def make_registry(engine) -> CollectorRegistry:
    """Gauges read at scrape time (the hot path pays nothing for them), and counters and
    histograms the engine feeds once per generation, as it ends."""
    registry = CollectorRegistry()
    Gauge("mlx_active_sequences", "Generations running or waiting for a batch slot", registry=registry).set_function(
        lambda: engine.active_count
    )
    Gauge("mlx_prompt_cache_bytes", "Bytes held by the prefix KV cache", registry=registry).set_function(
        lambda: engine.prompt_cache.nbytes
    )
    Gauge("mlx_prompt_cache_entries", "Sequences held by the prefix KV cache", registry=registry).set_function(
        lambda: len(engine.prompt_cache)
    )
    Gauge("mlx_prompt_cache_limit_bytes", "Byte cap of the prefix KV cache", registry=registry).set_function(
        lambda: engine.prompt_cache.max_bytes
    )
    Gauge("mlx_queue_depth", "Generations waiting for KV-cache room or a batch slot", registry=registry).set_function(
        lambda: engine.queue_depth
    )
    Gauge("mlx_kv_cache_reserved_tokens", "KV-cache tokens the running generations may grow to (batch-padded)",
          registry=registry).set_function(lambda: engine.kv_tokens_reserved)
    Gauge("mlx_kv_cache_limit_tokens", "KV-cache budget in tokens (0: no cap)", registry=registry).set_function(
        lambda: engine.kv_tokens
    )
    Gauge("mlx_memory_active_bytes", "Bytes MLX has allocated", registry=registry).set_function(mx.get_active_memory)
    Gauge("mlx_memory_cache_bytes", "Freed bytes MLX keeps for reuse", registry=registry).set_function(mx.get_cache_memory)
    Gauge("mlx_memory_peak_bytes", "Most bytes MLX has had allocated", registry=registry).set_function(mx.get_peak_memory)
    ProcessCollector(registry=registry)
    engine.on_finish = _GenerationMetrics(registry).observe
    return registry


class _GenerationMetrics:
    """Observed once per generation, as it ends, on the engine thread: nothing per token."""

    def __init__(self, registry: CollectorRegistry):
        self.finished = Counter("mlx_generations", "Generations ended, by reason", ["reason"], registry=registry)
        self.prompt_tokens = Counter("mlx_prompt_tokens", "Prompt tokens of every generation", registry=registry)
        self.cached_tokens = Counter("mlx_prompt_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=registry)
        self.cache_lookups = Counter("mlx_prompt_cache_lookups", "Generations by prefix-cache result", ["result"], registry=registry)
        self.generated = Counter("mlx_generated_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram(
            "mlx_time_to_first_token_seconds", "From the engine receiving a request to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
        self.per_token = Histogram(
            "mlx_time_per_output_token_seconds", "Each generation's mean time between tokens after the first",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=registry,
        )

    def observe(self, reason: str, usage, timings, wait_s: float) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.cache_lookups.labels("hit" if usage.cached_tokens else "miss").inc()
        self.generated.inc(usage.completion_tokens)
        if timings.predicted_n:
            self.ttft.observe(wait_s + timings.prompt_ms / 1000.0)
        if timings.predicted_n > 1:
            self.per_token.observe(timings.predicted_ms / 1000.0 / (timings.predicted_n - 1))


class RequestMetrics:
    """Pure ASGI middleware counting HTTP requests by route template and status (outermost, so
    auth and body-size refusals count too)."""

    def __init__(self, app, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter("mlx_http_requests", "HTTP requests by route and status", ["route", "status"], registry=registry)
        self._paths: set[str] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = False

        async def send_with_status(message):
            nonlocal counted
            if message["type"] == "http.response.start":
                # Counted as the answer starts: a client that has its answer sees it in /metrics.
                counted = True
                self.requests.labels(self._route(scope), str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            if not counted:  # no answer at all: the server failed
                self.requests.labels(self._route(scope), "500").inc()

    def _route(self, scope) -> str:
        """The matched route's template; a raw path would let any client grow the series without end."""
        route = scope.get("route")
        if route is not None and hasattr(route, "path"):
            return route.path
        if self._paths is None:  # refused before routing (401, 413): a documented path, or none
            self._paths = set(scope["app"].openapi().get("paths", {}))
        return scope["path"] if scope["path"] in self._paths else "unmatched"


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
