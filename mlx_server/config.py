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
    metrics: bool = True
    cors_origins: tuple[str, ...] = ()
    # Memory (engine/memory.py); None means the safe default computed at start-up.
    memory_limit: int | None = None
    cache_limit: int | None = None
    kv_cache_limit: int | None = None
    # Chat semantics (api/output.py): a chat template in place of the model's, the tool-call
    # format (a name from mlx-lm's tool_parsers; None: inferred), how reasoning is returned.
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_format: str = "deepseek"  # deepseek / reasoning_content, reasoning, none
    # Images and videos for vision models (media.py): remote http(s) fetches, and the size cap of each.
    remote_media: bool = True
    max_media_bytes: int = 20 << 20
