"""Server settings, filled from the command line (see cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 10 * 1024 * 1024


@dataclass
class Settings:
    model_id: str
    ctx_size: int = 4096
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str = ""
    max_body_bytes: int = MAX_BODY_BYTES
    max_stop_strings: int = 16
    max_stop_length: int = 512
    max_concurrency: int = 32
    max_queue: int = 64
    prompt_cache_bytes: int = 2 << 30
