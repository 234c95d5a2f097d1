"""Server logging: every line goes to stdout with the `[mlx] ` prefix, flushed per line (SPEC §1)."""

import logging
import sys

PREFIX = "[mlx] "


class _FlushingStdoutHandler(logging.StreamHandler):
    def __init__(self):
        super().__init__(sys.stdout)

    def emit(self, record):
        # sys.stdout may have been replaced (tests, pythonw): always write to the current one.
        self.stream = sys.stdout
        super().emit(record)
        self.flush()


def setup_logging(level: int = logging.INFO) -> None:
    """Route our logger and uvicorn's through one `[mlx] ` stdout handler."""
    handler = _FlushingStdoutHandler()
    handler.setFormatter(logging.Formatter(PREFIX + "%(message)s"))
    for name in ("mlx_server", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level)
        logger.propagate = False
    logging.getLogger("uvicorn.access").disabled = True


def set_rank(rank: int) -> None:
    """On a follower rank of a distributed group, every line says which rank it comes from."""
    global PREFIX
    PREFIX = f"[mlx] [rank {rank}] "
    setup_logging()


def say(message: str) -> None:
    """Print one `[mlx] ` line to stdout at once (the lines Jan watches for)."""
    print(PREFIX + message, flush=True)


def fatal(message: str) -> None:
    """A fatal error: to stderr (Jan reads it to classify an early exit) and to stdout."""
    say(message)
    print(message, file=sys.stderr, flush=True)


logger = logging.getLogger("mlx_server")
