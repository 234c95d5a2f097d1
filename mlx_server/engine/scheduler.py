"""The scheduler: one thread owns the model and runs mlx-lm's continuous-batching generator.

Handlers talk to it by messages: `submit` puts a sequence in the inbox and returns a handle
whose events arrive on the caller's asyncio loop; cancellation is a flag the thread checks
before every decode step, so it never depends on writing to a dead socket.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_server.engine.request import GenerationEvent, GenerationRequest, Timings, Usage
from mlx_server.engine.sampling import make_processors, make_sampler
from mlx_server.log import logger
from mlx_server.text.stop import StopMatcher


@dataclass
class _Sequence:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    detokenizer: object
    stop: StopMatcher
    cancelled: bool = False
    uid: int | None = None
    cached: int = 0
    generated: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    done: bool = field(default=False)


class EngineBusy(Exception):
    """Every batch slot and queue place is taken; the caller should answer 429."""


class GenerationHandle:
    """The caller's side of one generation: iterate its events, or cancel it."""

    def __init__(self, engine: "Engine", seq: _Sequence):
        self._engine = engine
        self._seq = seq

    @property
    def id(self) -> str:
        return self._seq.request.id

    def cancel(self) -> None:
        if not self._seq.done:
            self._engine._cancel(self._seq)

    async def events(self):
        """Yields GenerationEvents; the last one has a `finish_reason`."""
        while True:
            event = await self._seq.events.get()
            yield event
            if event.finish_reason is not None:
                return


class Engine:
    """Owns the model and the KV caches; everything else reaches it through `submit`/`cancel_all`."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        completion_batch_size: int = 32,
        prefill_step_size: int = 2048,
        prompt_cache_bytes: int = 2 << 30,
        max_queue: int = 64,
    ):
        self.model = model
        self.tokenizer = tokenizer
        # Finished sequences' KV caches, keyed by their tokens, so a re-sent conversation only
        # prefills what is new. mlx-lm's LRU evicts until its byte total is under the cap.
        self.prompt_cache = LRUPromptCache(max_size=1 << 30, max_bytes=prompt_cache_bytes)
        self._cache_enabled = prompt_cache_bytes > 0
        self.max_live = completion_batch_size + max_queue
        self._batch_args = dict(
            completion_batch_size=completion_batch_size,
            prefill_step_size=prefill_step_size,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Sequence] = {}
        self._live_lock = threading.Lock()
        self._active: dict[int, _Sequence] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._gen: BatchGenerator | None = None

    # ---- the caller's side (any thread, usually the event loop) ----

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self.cancel_all()
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        loop = asyncio.get_running_loop()
        detokenizer = copy.copy(self.tokenizer.detokenizer)
        detokenizer.reset()
        seq = _Sequence(request, loop, asyncio.Queue(), detokenizer, StopMatcher(request.stop))
        with self._live_lock:
            if len(self._live) >= self.max_live:
                raise EngineBusy(f"the server is busy: {len(self._live)} generations are running or waiting")
            self._live[request.id] = seq
        self._inbox.put(seq)
        return GenerationHandle(self, seq)

    def cancel_all(self) -> int:
        """Cancel every live generation; returns how many there were."""
        with self._live_lock:
            seqs = list(self._live.values())
        for seq in seqs:
            self._cancel(seq)
        return len(seqs)

    def cancel_id(self, request_id: str) -> int:
        with self._live_lock:
            seq = self._live.get(request_id)
        if seq is None:
            return 0
        self._cancel(seq)
        return 1

    @property
    def active_count(self) -> int:
        with self._live_lock:
            return len(self._live)

    def _cancel(self, seq: _Sequence) -> None:
        seq.cancelled = True
        self._inbox.put(_WAKE)

    # ---- the engine thread ----

    def _run(self) -> None:
        self._gen = BatchGenerator(self.model, **self._batch_args)
        while not self._stopping:
            self._admit(block=not self._active)
            self._drop_cancelled()
            if not self._active:
                continue
            try:
                _, responses = self._gen.next()
            except Exception as e:  # a failed step must not kill the thread or later requests
                logger.exception("generation step failed")
                self._fail_all(f"generation failed: {e}")
                continue
            for r in responses:
                seq = self._active.get(r.uid)
                if seq is not None:
                    self._on_token(seq, r)

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Sequence) and not item.cancelled:
                self._insert(item)
            elif isinstance(item, _Sequence):
                self._finish(item, "stop", "")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _insert(self, seq: _Sequence) -> None:
        req = seq.request
        tokens = req.prompt_tokens
        try:
            cache, rest = None, tokens
            if self._cache_enabled:
                cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, tokens)
                if cache is not None and not rest:
                    # The whole prompt is cached, but the last token must be run to get logits.
                    if can_trim_prompt_cache(cache):
                        trim_prompt_cache(cache, 1)
                        rest = tokens[-1:]
                    else:
                        cache, rest = None, tokens
            seq.cached = len(tokens) - len(rest)
            (uid,) = self._gen.insert(
                [rest],
                max_tokens=[req.max_tokens],
                caches=[cache],
                all_tokens=[tokens[: seq.cached]],
                samplers=[make_sampler(req.sampling)],
                logits_processors=[make_processors(req.sampling)],
            )
        except Exception as e:
            logger.exception("could not start a generation")
            self._finish(seq, "error", "", error=f"could not start the generation: {e}")
            return
        seq.uid = uid
        seq.t_start = time.perf_counter()
        self._active[uid] = seq

    def _drop_cancelled(self) -> None:
        gone = [seq for seq in self._active.values() if seq.cancelled]
        if gone:
            self._remove(gone)
            for seq in gone:
                self._finish(seq, "stop", self._flush(seq))

    def _on_token(self, seq: _Sequence, r) -> None:
        seq.generated += 1
        if seq.generated == 1:
            seq.t_first = time.perf_counter()
        if r.finish_reason is not None:
            self._keep_cache(r.all_tokens, r.prompt_cache)
        if r.finish_reason == "stop":  # an end-of-sequence token: never shown
            self._finish(seq, "stop", self._flush(seq))
            return
        seq.detokenizer.add_token(r.token)
        text = seq.stop.feed(seq.detokenizer.last_segment)
        if seq.stop.stopped is not None:
            self._remove([seq])
            self._finish(seq, "stop", text)
        elif r.finish_reason == "length":
            self._finish(seq, "length", text + self._flush(seq))
        elif text:
            self._emit(seq, GenerationEvent(text=text))

    def _remove(self, seqs: list[_Sequence]) -> None:
        """Take sequences out of the batch before their natural end, keeping their KV caches."""
        caches = self._gen.remove([s.uid for s in seqs], return_prompt_caches=self._cache_enabled)
        for cache, tokens in caches.values():
            self._keep_cache(tokens, cache)

    def _keep_cache(self, tokens, cache) -> None:
        if self._cache_enabled and tokens and cache:
            self.prompt_cache.insert_cache(_MODEL_KEY, list(tokens), cache)

    @staticmethod
    def _flush(seq: _Sequence) -> str:
        """The text still held by the detokenizer and the stop matcher."""
        seq.detokenizer.finalize()
        return seq.stop.feed(seq.detokenizer.last_segment) + seq.stop.finish()

    def _finish(self, seq: _Sequence, reason: str, text: str, error: str | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        self._active.pop(seq.uid, None)
        with self._live_lock:
            self._live.pop(seq.request.id, None)
        now = time.perf_counter()
        first = seq.t_first or now
        timings = Timings(
            prompt_n=len(seq.request.prompt_tokens) - seq.cached,
            cache_n=seq.cached,
            prompt_ms=1000.0 * (first - seq.t_start) if seq.t_start else 0.0,
            predicted_n=seq.generated,
            predicted_ms=1000.0 * (now - first),
        )
        usage = Usage(len(seq.request.prompt_tokens), seq.generated, cached_tokens=seq.cached)
        why = "cancelled" if seq.cancelled else reason
        logger.info(
            "%s %s: %d prompt tokens (%d cached), %d generated, %.1f tokens/s",
            seq.request.id, why, usage.prompt_tokens, seq.cached, usage.completion_tokens,
            timings.as_dict()["predicted_per_second"],
        )
        self._emit(seq, GenerationEvent(text=text, finish_reason=reason, usage=usage, timings=timings, error=error))

    def _fail_all(self, message: str) -> None:
        for seq in list(self._active.values()):
            self._finish(seq, "error", "", error=message)
        self._gen.close()
        mx.clear_cache()
        self._gen = BatchGenerator(self.model, **self._batch_args)

    @staticmethod
    def _emit(seq: _Sequence, event: GenerationEvent) -> None:
        try:
            seq.loop.call_soon_threadsafe(seq.events.put_nowait, event)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


_WAKE = object()
_MODEL_KEY = "model"  # one model per process; mlx-lm's cache can hold several
