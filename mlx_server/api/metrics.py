"""GET /metrics in Prometheus text format (prometheus-client), from the engine's live state."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

router = APIRouter()


def make_registry(engine) -> CollectorRegistry:
    """Gauges read at scrape time, so the hot path pays nothing for them."""
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
    return registry


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
