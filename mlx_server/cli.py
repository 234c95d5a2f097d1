"""Command line: parse the options Jan passes, load the model, serve, and exit cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import faulthandler
import ipaddress
import math
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
    p.add_argument("--memory-limit", type=_size, default=None, help="MLX memory limit, e.g. 12G (default: the GPU's recommended working set on Metal, else MLX's 80%% of RAM); MLX enforces it on Metal, and the KV cache budget is planned within it")
    p.add_argument("--cache-limit", type=_size, default=None, help="freed buffers MLX keeps for reuse (default: 1G, or a quarter of --memory-limit if smaller)")
    p.add_argument("--kv-cache-limit", type=_size, default=None, help="KV cache memory all running generations may use together: requests wait for room, a completion stops with 'length' at it, a prompt that cannot fit is a 400; 0 = no cap (default: 75%% of what --memory-limit leaves after the weights and caches, at least one --ctx-size)")
    p.add_argument("--metrics", choices=["on", "off"], default="on", help="Prometheus metrics at /metrics, behind --api-key when one is set (default on)")
    p.add_argument("--cors-origins", default="", help="comma-separated origins that browsers may call the API from, e.g. http://localhost:1420, or '*' (default: none, CORS off)")
    p.add_argument("--chat-template", metavar="FILE", default=None, help="a Jinja chat template file to use in place of the model's own")
    p.add_argument("--tool-call-parser", metavar="NAME", default=None, help="the model's tool-call format, one of mlx-lm's tool parsers (json_tools, qwen3_coder, mistral, pythonic...) or llama3_json (Llama 3.1-3.3); default: inferred from the chat template")
    p.add_argument("--no-remote-media", dest="remote_media", action="store_false", help="never fetch http(s) image or video URLs (for servers next to private services); file paths and data: URLs still work")
    p.add_argument("--max-media-size", type=_size, default=20 << 20, help="largest image or video file a request may name, e.g. 20M (default 20M)")
    p.add_argument("--reasoning-format", choices=["deepseek", "reasoning_content", "reasoning", "none"], default="deepseek", help="where <think> reasoning goes: deepseek (alias reasoning_content) = message.reasoning_content, reasoning = message.reasoning, none = left inline in the content (default deepseek)")
    p.add_argument("--dequantize", choices=["auto", "on", "off"], default="auto", help="dequantize quantized weights to float32 (auto: on CPUs when it fits in a quarter of RAM; faster there)")
    p.add_argument("--fuse-projections", choices=["auto", "on", "off"], default="auto", help="join each layer's q/k/v and gate/up projections into one matmul each (llama, mistral, qwen2, qwen3; never with --parallel tensor); auto: on GPUs, where it measured faster (on CPUs it did not)")
    p.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto", help="run each layer's work around the attention as mx.compile'd functions in decode steps (llama, mistral, qwen2, qwen3; never with --parallel tensor); auto: on GPUs")
    p.add_argument("--no-openblas", dest="openblas", action="store_false", help="do not load the system OpenBLAS in place of the mlx-cpu wheel's reference BLAS (Linux)")
    p.add_argument("--parallel", choices=["pipeline", "tensor"], default=None, help="one model across the ranks started by mlx.launch: pipeline = each rank holds a run of layers, tensor = each rank holds a slice of every layer; rank 0 serves HTTP (README: Several machines)")
    p.add_argument("--peer-timeout", type=float, default=300.0, help="with --parallel: seconds the ranks may take to connect, and one scheduler step (a whole prompt's prefill) may wait for the other ranks, before the group gives up and exits (default 300)")
    p.add_argument("--version", action="version", version=f"mlx-server {__version__}")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be between 1 and 65535, got {args.port}")
    if args.ctx_size < 1:
        p.error(f"--ctx-size must be positive, got {args.ctx_size}")
    if args.max_concurrency < 1 or args.max_queue < 0:
        p.error("--max-concurrency must be at least 1 and --max-queue at least 0")
    if not args.peer_timeout > 0:
        p.error(f"--peer-timeout must be positive, got {args.peer_timeout}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    from mlx_server.engine.device import preload_openblas

    blas = preload_openblas() if args.openblas else None
    from mlx_server.engine.loader import ModelError, default_model_path, derive_model_id, load_model, resolve_model_path

    group = _join_group(args)
    say("mlx-server starting...")
    try:
        model_arg = args.model or str(default_model_path())
        say(f"Model path: {model_arg}")
        say(f"Port: {args.port}")
        say(f"Context size: {args.ctx_size}")
        path = resolve_model_path(model_arg)
        say(f"Loading model from: {path}")
        loaded = load_model(path, dequantize=args.dequantize, group=group, parallel=args.parallel, fuse=args.fuse_projections,
                            compile_decode=args.compile_decode)
        if group is not None:
            _check_same_setup(group, path, args)
    except ModelError as e:
        fatal(f"Error: {e}")
        sys.exit(1)
    chat_template = _chat_semantics_options(args)

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
        metrics=args.metrics == "on",
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        memory_limit=args.memory_limit,
        cache_limit=args.cache_limit,
        kv_cache_limit=args.kv_cache_limit,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_format=args.reasoning_format,
        remote_media=args.remote_media,
        max_media_bytes=args.max_media_size,
    )
    if loaded.context_length and settings.ctx_size > loaded.context_length:
        logger.warning("--ctx-size %d is larger than the model's trained context (%d)", settings.ctx_size, loaded.context_length)
    if not _is_loopback(settings.host) and not api_key:
        logger.warning("WARNING: listening on %s without an API key: anyone who can reach this machine can use the model", settings.host)
    if blas:
        logger.info("CPU BLAS: %s", blas)
    say(f"Model loaded: {settings.model_id} ({loaded.weights}{', takes images and video' if loaded.vision else ''})")
    serve(loaded, settings, group=group, peer_timeout=args.peer_timeout)


def _join_group(args):
    """The distributed group when started by mlx.launch with --parallel; a follower rank's log
    lines say which rank they come from. A group that cannot form is a fatal start-up error."""
    if not args.parallel:
        return None
    from mlx_server.engine.distributed import init_group
    from mlx_server.log import set_rank

    # The ring backend waits for every rank without a time limit, holding the interpreter: a rank
    # that never starts (a wrong path on another host) must end this one, not hang it. faulthandler's
    # timer runs outside the interpreter.
    logger.info("joining the distributed group: waiting up to %.0f s for every rank (--peer-timeout)", args.peer_timeout)
    faulthandler.dump_traceback_later(args.peer_timeout, exit=True, file=sys.stderr)
    try:
        group = init_group(args.parallel)
    except Exception as e:
        fatal(f"Error: could not join the distributed group: {e}")
        sys.exit(1)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if group is not None and group.rank() != 0:
        set_rank(group.rank())
    if group is not None:
        logger.info("rank %d of %d (pid %d)", group.rank(), group.size(), os.getpid())
    return group


def _check_same_setup(group, path, args) -> None:
    """Every rank must load the same model files with the same scheduling flags, or the ranks
    would drift apart; a mismatch is a start-up error on every rank."""
    import hashlib

    from mlx_server.engine.distributed import group_min
    from mlx_server.engine.loader import ModelError

    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        f = path / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    for value in (args.parallel, args.max_concurrency, args.max_queue, args.prompt_cache_bytes, args.dequantize):
        h.update(repr(value).encode())
    mine = int.from_bytes(h.digest()[:7], "big")
    lowest, highest = group_min(group, mine), -group_min(group, -mine)  # both on every rank, always
    if lowest != highest:
        raise ModelError(
            "the ranks do not agree: their model files (config.json, tokenizer, weight index) or their "
            "--parallel/--max-concurrency/--max-queue/--prompt-cache-bytes/--dequantize differ; give every rank the same"
        )


def serve(loaded, settings: Settings, group=None, peer_timeout: float = 300.0) -> None:
    from mlx_server.api.app import create_app
    from mlx_server.engine.memory import apply_mlx_limits, format_bytes, plan_memory
    from mlx_server.engine.scheduler import Engine

    plan = plan_memory(
        loaded.model,
        ctx_size=settings.ctx_size,
        prompt_cache_bytes=settings.prompt_cache_bytes,
        memory_limit=settings.memory_limit,
        cache_limit=settings.cache_limit,
        kv_limit=settings.kv_cache_limit,
    )
    apply_mlx_limits(plan)
    kv = f"{format_bytes(plan.kv_limit)} ({plan.kv_tokens} tokens)" if plan.kv_tokens else "no cap"
    logger.info(
        "Memory: limit %s, MLX buffer cache %s, weights %s, KV cache %s",
        format_bytes(plan.memory_limit), format_bytes(plan.cache_limit), format_bytes(plan.weights), kv,
    )
    if plan.kv_tokens and plan.kv_tokens < settings.ctx_size:
        logger.warning("the KV cache cap holds %d tokens, less than --ctx-size %d: longer prompts are refused", plan.kv_tokens, settings.ctx_size)
    channel, kv_tokens, cache_bytes = None, plan.kv_tokens, settings.prompt_cache_bytes
    if group is not None:
        from mlx_server.engine.distributed import StepChannel, group_min

        # One budget for the whole group (the smallest rank's), and prompt-cache caps in proportion
        # to the layers each rank holds, so that every rank keeps and evicts the same prefixes.
        kv_tokens = group_min(group, kv_tokens or NO_CAP)
        kv_tokens = 0 if kv_tokens == NO_CAP else kv_tokens
        cache_bytes = _rank_cache_bytes(loaded, settings.prompt_cache_bytes)
        channel = StepChannel(group, timeout=peer_timeout)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        completion_batch_size=settings.max_concurrency,
        prompt_cache_bytes=cache_bytes,
        max_queue=settings.max_queue,
        kv_tokens=kv_tokens,
        vision=loaded.vision if group is None else None,
        channel=channel,
    )
    if channel is not None and not channel.is_leader:
        _follow(engine, channel)
    if channel is not None:
        channel.on_timeout = lambda: engine.fail_group("another rank stopped answering (--peer-timeout)")
    engine.start()
    _warm_up(engine)
    if engine.failed:
        fatal(f"Error: {engine.failed}")
        os._exit(1)
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
    # A failed group (a rank died or hung) ends the server: in-flight requests have their error by now.
    engine.on_group_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    engine.stop(timeout=0.5)
    _last_words("server stopped")
    # Skip interpreter teardown: a prefill still running on the engine thread must not delay exit.
    os._exit(0 if server.started and not engine.failed else 1)


def _last_words(message: str) -> None:
    """A final log line; stdout may be a pipe whose reader is gone (a killed launcher), and that
    must not keep the process from exiting."""
    try:
        say(message)
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


NO_CAP = 1 << 62


def _rank_cache_bytes(loaded, total: int) -> int:
    """This rank's share of --prompt-cache-bytes. Under a pipeline a rank holds layers/total_layers of
    every cached prefix; scaling its cap the same way makes every rank evict exactly the same entries."""
    config = loaded.config or {}
    total_layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    local = len(getattr(loaded.model, "layers", []) or [])
    if not total_layers or not local or local >= total_layers:
        return total
    return total * local // total_layers


def _follow(engine, channel) -> None:
    """A follower rank: no HTTP, run rank 0's steps until it stops the group, then exit."""
    import signal

    # mlx.launch stops every rank with SIGTERM: end at once, without waiting for the group.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0 if not engine.failed else 1))
    channel.on_timeout = lambda: os._exit(1)
    logger.info("following rank 0")
    status = engine.follow()
    _last_words(f"stopped ({'the group failed' if status else 'rank 0 stopped'})")
    os._exit(status)


def _warm_up(engine) -> None:
    """One tiny generation before the readiness lines, so the first request pays no one-time setup."""
    import asyncio

    from mlx_server.engine.request import GenerationRequest, SamplingParams

    async def run():
        tokens = engine.tokenizer.encode("Hello, world", add_special_tokens=False)
        handle = engine.submit(GenerationRequest("warm-up", tokens, 2, SamplingParams(temperature=0)))
        async for _ in handle.events():
            pass

    asyncio.run(run())


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
        if self.engine.channel is not None:
            # One rank of several: mlx.launch sends SIGTERM when another rank has died; a client
            # cut off mid-answer must see an error, not an answer that merely stops.
            self.engine.cancel_error = "the server is shutting down"
        self.engine.cancel_all()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown, which would end the process
        # "killed by SIGTERM"; Jan expects a clean exit 0.
        self._captured_signals.clear()


def _chat_semantics_options(args) -> str | None:
    """Check --tool-call-parser and read --chat-template; a bad one is a fatal error before readiness."""
    from mlx_server.text.tool_calls import tool_format_names

    if args.tool_call_parser and args.tool_call_parser not in tool_format_names():
        fatal(f"Error: unknown --tool-call-parser {args.tool_call_parser!r}; known: {', '.join(tool_format_names())}")
        sys.exit(1)
    if not args.chat_template:
        return None
    import jinja2

    try:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
        jinja2.Environment().parse(template)
    except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as e:
        fatal(f"Error: cannot use --chat-template {args.chat_template}: {e}")
        sys.exit(1)
    return template


def _size(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    if not math.isfinite(value):
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
