"""Command line: parse the options Jan passes, load the model, serve, and exit cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

import uvicorn

from mlx_server import __version__
from mlx_server.config import Settings
from mlx_server.log import fatal, logger, say, setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlx-server", description="OpenAI/Anthropic-compatible server for MLX models")
    p.add_argument("-m", "--model", default="", help="model directory, a file in one, or a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; anything else needs care: see --api-key)")
    p.add_argument("--ctx-size", type=int, default=4096, help="context window in tokens: prompt + completion never exceed it (default 4096)")
    p.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key) on every route but /health; default $MLX_API_KEY, else none")
    p.add_argument("--model-id", default="", help="the model id the API reports (default: derived from --model)")
    p.add_argument("--max-concurrency", type=int, default=32, help="sequences decoded together in one batch (default 32)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a batch slot; beyond that a 429 (default 64)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=2 << 30, help="byte cap of the prefix KV cache kept between requests, e.g. 512M, 2G; 0 turns it off (default 2G)")
    p.add_argument("--dequantize", choices=["auto", "on", "off"], default="auto", help="dequantize quantized weights to float32 (auto: on CPUs when it fits in a quarter of RAM; faster there)")
    p.add_argument("--no-openblas", dest="openblas", action="store_false", help="do not load the system OpenBLAS in place of the mlx-cpu wheel's reference BLAS (Linux)")
    p.add_argument("--version", action="version", version=f"mlx-server {__version__}")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be between 1 and 65535, got {args.port}")
    if args.ctx_size < 1:
        p.error(f"--ctx-size must be positive, got {args.ctx_size}")
    if args.max_concurrency < 1 or args.max_queue < 0:
        p.error("--max-concurrency must be at least 1 and --max-queue at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    from mlx_server.engine.device import preload_openblas

    blas = preload_openblas() if args.openblas else None
    from mlx_server.engine.loader import ModelError, default_model_path, derive_model_id, load_model, resolve_model_path

    say("mlx-server starting...")
    try:
        model_arg = args.model or str(default_model_path())
        say(f"Model path: {model_arg}")
        say(f"Port: {args.port}")
        say(f"Context size: {args.ctx_size}")
        path = resolve_model_path(model_arg)
        say(f"Loading model from: {path}")
        loaded = load_model(path, dequantize=args.dequantize)
    except ModelError as e:
        fatal(f"Error: {e}")
        sys.exit(1)

    api_key = args.api_key if args.api_key is not None else os.environ.get("MLX_API_KEY", "")
    settings = Settings(
        model_id=args.model_id or derive_model_id(model_arg),
        ctx_size=args.ctx_size,
        host=args.host,
        port=args.port,
        api_key=api_key,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        prompt_cache_bytes=args.prompt_cache_bytes,
    )
    if loaded.context_length and settings.ctx_size > loaded.context_length:
        logger.warning("--ctx-size %d is larger than the model's trained context (%d)", settings.ctx_size, loaded.context_length)
    if not _is_loopback(settings.host) and not api_key:
        logger.warning("WARNING: listening on %s without an API key: anyone who can reach this machine can use the model", settings.host)
    if blas:
        logger.info("CPU BLAS: %s", blas)
    say(f"Model loaded: {settings.model_id} ({loaded.weights})")
    serve(loaded, settings)


def serve(loaded, settings: Settings) -> None:
    from mlx_server.api.app import create_app
    from mlx_server.engine.scheduler import Engine

    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        completion_batch_size=settings.max_concurrency,
        prompt_cache_bytes=settings.prompt_cache_bytes,
        max_queue=settings.max_queue,
    )
    engine.start()
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=1,
        lifespan="off",
    )
    server = _Server(config, engine)
    server.run()
    engine.stop(timeout=0.5)
    say("server stopped")
    sys.stdout.flush()
    # Skip interpreter teardown: a prefill still running on the engine thread must not delay exit.
    os._exit(0 if server.started else 1)


class _Server(uvicorn.Server):
    """uvicorn, plus our readiness lines once the socket is bound, and generations ended at SIGTERM."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.config.host, self.config.port
            say(f"http server listening on http://{host}:{port}")
            say(f"server is listening on {host}:{port}")

    def handle_exit(self, sig, frame) -> None:
        self.engine.cancel_all()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown, which would end the process
        # "killed by SIGTERM"; Jan expects a clean exit 0.
        self._captured_signals.clear()


def _size(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {text!r}")
    return int(value)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
