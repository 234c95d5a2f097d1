"""In-process fixtures for the hardening tests that need no server process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def idle_engine(tiny_model_dir):
    """The tiny model's Engine, never started: enough to build the app and its serving objects."""
    from mlx_server.engine.loader import load_model
    from mlx_server.engine.scheduler import Engine

    loaded = load_model(tiny_model_dir)
    return Engine(loaded.model, loaded.tokenizer)
