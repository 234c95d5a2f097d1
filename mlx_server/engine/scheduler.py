"""The scheduler: one thread owns the model and runs mlx-lm's continuous-batching generator.

Handlers talk to it by messages: `submit` puts a sequence in the inbox and returns a handle
whose events arrive on the caller's asyncio loop; cancellation is a flag the thread checks
before every decode step, so it never depends on writing to a dead socket.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_server.engine.batch import make_batch_generator
from mlx_server.engine.distributed import GroupFailed, Step, request_from_wire, request_to_wire, token_checksum
from mlx_server.engine.guidance import GrammarProcessor
from mlx_server.engine.memory import batch_fits
from mlx_server.engine.request import GenerationEvent, GenerationRequest, Timings, TokenLogprob, Usage
from mlx_server.engine.sampling import greedy, make_processors, make_sampler, token_logprob
from mlx_server.log import logger
from mlx_server.text.stop import StopMatcher


@dataclass
class _Sequence:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop | None  # None on a follower rank: nobody listens there
    events: asyncio.Queue | None
    detokenizer: object
    stop: StopMatcher
    cancelled: bool = False  # asked for, from any thread, at any time
    cancel_seen: bool = False  # taken into account by the engine thread at a step boundary
    uid: int | None = None
    cached: int = 0
    generated: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    done: bool = field(default=False)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent with an event
    t_submit: float = field(default_factory=time.perf_counter)
    failure: Exception | None = None  # raised by this sequence's own sampler or processors

    @property
    def need(self) -> int:
        """The most KV-cache tokens this sequence can come to hold."""
        return len(self.request.prompt_tokens) + self.request.max_tokens


class EngineBusy(Exception):
    """Every batch slot and queue place is taken; the caller should answer 429."""


class KVCapExceeded(Exception):
    """The prompt alone needs more KV cache than the memory cap allows; retrying cannot help."""


class EngineUnavailable(Exception):
    """The engine cannot run generations any more (a rank of its group failed); the caller answers 503."""


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
        kv_tokens: int = 0,
        vision=None,
        channel=None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.vision = vision  # engine/vision.py's Vision when the model takes images, else None
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
        # KV-cache budget in tokens (0: none): sequences that do not fit yet wait here, in order.
        self.kv_tokens = kv_tokens
        self._waiting: deque[_Sequence] = deque()
        # Called on the engine thread as each generation ends (metrics); must be quick.
        self.on_finish = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._gen = None  # batch.py's generator, made on the engine thread
        # distributed.StepChannel when this engine is one rank of several (rank 0 decides, the
        # others follow step by step); None for a single process.
        self.channel = channel
        self.failed: str | None = None  # why the group cannot go on; submit() then refuses
        self.on_group_failure = None  # called once when the group fails (rank 0 shuts the server down)
        # Set before cancel_all() when a cancelled generation must end as an error (a shutdown that
        # cuts answers off), not as a normal stop.
        self.cancel_error: str | None = None

    # ---- the caller's side (any thread, usually the event loop) ----

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self.cancel_all()
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        if self.failed:
            raise EngineUnavailable(self.failed)
        self._fit_to_kv_budget(request)
        seq = self._sequence(request, asyncio.get_running_loop())
        with self._live_lock:
            if self.failed:
                raise EngineUnavailable(self.failed)
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

    def _fit_to_kv_budget(self, request: GenerationRequest) -> None:
        """A completion that could outgrow the KV budget is shortened (it ends with `length`)."""
        budget = self.kv_tokens
        n_prompt = len(request.prompt_tokens)
        if not budget or n_prompt + request.max_tokens <= budget:
            return
        if n_prompt >= budget:
            raise KVCapExceeded(
                f"This prompt is {n_prompt} tokens, but the server's KV cache memory cap holds {budget} tokens "
                f"(its --kv-cache-limit). Shorten the messages or start the server with a larger --kv-cache-limit."
            )
        request.max_tokens = budget - n_prompt

    @property
    def active_count(self) -> int:
        """Generations running or waiting for a batch slot."""
        with self._live_lock:
            return len(self._live)

    @property
    def queue_depth(self) -> int:
        """Generations not yet prefilling: waiting for KV-cache room or for a batch slot."""
        gen = self._gen
        return len(self._waiting) + len(getattr(gen, "_unprocessed_sequences", ()))

    @property
    def kv_tokens_reserved(self) -> int:
        """The KV budget the running sequences hold (batch-padded: count times the longest)."""
        needs = [s.need for s in list(self._active.values())]
        return len(needs) * max(needs) if needs else 0

    def _cancel(self, seq: _Sequence) -> None:
        seq.cancelled = True
        self._inbox.put(_WAKE)

    # ---- the engine thread ----

    def _run(self) -> None:
        self._gen = make_batch_generator(self.model, **self._batch_args)
        checksum = 0  # of the tokens sampled in the last step (ranks compare theirs with rank 0's)
        try:
            while True:
                added, cancel, stop = self._next_step(checksum)
                if stop:
                    return
                self._waiting.extend(added)
                for seq in cancel:
                    seq.cancel_seen = True
                self._drop_cancelled()
                self._start_waiting()
                checksum = 0
                if not self._active:
                    continue
                try:
                    if self.channel is None:
                        _, responses = self._gen.next()
                    else:
                        with self.channel.busy():
                            _, responses = self._gen.next()
                        checksum = token_checksum(responses)
                except Exception as e:  # a failed step must not kill the thread or later requests
                    if self.channel is not None:  # but ranks that missed a step cannot go on
                        raise GroupFailed(f"a generation step failed: {e}") from e
                    logger.exception("generation step failed")
                    self._fail_all(public_error("generation failed", e))
                    continue
                for r in responses:
                    seq = self._active.get(r.uid)
                    if seq is not None:
                        self._on_token(seq, r)
                self._drop_failed()
        except GroupFailed as e:
            self.fail_group(f"the model's distributed group failed: {e}")
        except Exception as e:
            if self.channel is None:
                raise
            # Any other failure leaves this rank out of step with the others: the group must end.
            logger.exception("the engine failed")
            self.fail_group(f"the model's distributed group failed: {public_error('engine error', e)}")

    def _next_step(self, checksum: int) -> tuple[list[_Sequence], list[_Sequence], bool]:
        """(sequences to add, sequences to cancel, stop) for the next step: decided here on a single
        process or rank 0, and received from rank 0 on the other ranks."""
        if self.channel is not None and not self.channel.is_leader:
            step, leader_checksum = self.channel.exchange(None, 0)
            if leader_checksum != checksum:
                raise GroupFailed(f"rank {self.channel.rank} sampled different tokens from rank 0 (the ranks are out of step)")
            added = [self._sequence(request_from_wire(d), None) for d in step.add]
            known = {s.request.id: s for s in [*self._waiting, *self._active.values(), *added]}
            return added, [known[i] for i in step.cancel if i in known], step.stop
        added = self._admit(block=not self._active and not self._waiting)
        cancel = [s for s in [*self._waiting, *self._active.values(), *added] if s.cancelled and not s.cancel_seen]
        stop = self._stopping
        if self.channel is not None:
            for seq in added:  # every rank must draw the same random numbers
                if seq.request.sampling.seed is None and seq.request.sampling.temperature > 0:
                    seq.request.sampling.seed = secrets.randbits(63)
            step = Step([request_to_wire(s.request) for s in added], [s.request.id for s in cancel], stop)
            self.channel.exchange(step, checksum)
        return added, cancel, stop

    def _sequence(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None) -> _Sequence:
        """A new sequence; with no loop (a follower rank's copy) its events go nowhere."""
        events = asyncio.Queue() if loop is not None else None
        return _Sequence(request, loop, events, _detokenizer(self.tokenizer, request), StopMatcher(request.stop))

    def follow(self) -> int:
        """Run as a follower rank on this thread until rank 0 stops the group; the exit status."""
        self._run()
        return 1 if self.failed else 0

    def fail_group(self, message: str) -> None:
        """The group cannot go on: every live generation ends with `message`, new ones are refused."""
        if self.failed:
            return
        self.failed = message
        logger.error("%s", message)
        with self._live_lock:
            seqs = list(self._live.values())
        for seq in seqs + list(self._waiting) + list(self._active.values()):
            self._finish(seq, "error", "", error=message)
        if self.on_group_failure is not None:
            self.on_group_failure()

    def _admit(self, block: bool) -> list[_Sequence]:
        """The sequences submitted since the last step (those cancelled meanwhile end here)."""
        added: list[_Sequence] = []
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return added
        while True:
            if isinstance(item, _Sequence) and not item.cancelled:
                added.append(item)
            elif isinstance(item, _Sequence):
                self._end_cancelled(item, "")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return added

    def _start_waiting(self) -> None:
        """Start waiting sequences, oldest first, while the batch still fits the KV budget."""
        while self._waiting:
            needs = [s.need for s in self._active.values()] + [self._waiting[0].need]
            if self._active and not batch_fits(needs, self.kv_tokens):
                return
            self._insert(self._waiting.popleft())

    def _insert(self, seq: _Sequence) -> None:
        req = seq.request
        tokens = req.prompt_tokens
        seq.t_start = time.perf_counter()
        try:
            cache, rest = None, tokens
            if self._cache_enabled:
                cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, _cache_key(req, tokens))
                if cache is not None and not rest:
                    # The whole prompt is cached, but the last token must be run to get logits.
                    if can_trim_prompt_cache(cache):
                        trim_prompt_cache(cache, 1)
                        rest = tokens[-1:]
                    else:
                        cache, rest = None, tokens
            seq.cached = len(tokens) - len(rest)
            rest = tokens[seq.cached:]
            if req.vision is not None and seq.cached <= req.vision.positions[-1]:
                # Images not all in the cached prefix: prefill up to the last token from their embeddings.
                cache = self.vision.prefill(req.vision, cache, seq.cached)
                rest = tokens[-1:]
            processors, sampler = make_processors(req.sampling), make_sampler(req.sampling)
            if req.grammar:  # last, so that no bias or penalty can lift a token it forbids
                grammar = GrammarProcessor(self.tokenizer, req.grammar)
                processors.append(grammar)
                sampler = grammar.sampler(sampler)
            processors = [_isolated(seq, p, fallback=lambda tokens, logits: logits) for p in processors]
            (uid,) = self._gen.insert(
                [rest],
                max_tokens=[req.max_tokens],
                caches=[cache],
                all_tokens=[tokens[: len(tokens) - len(rest)]],
                # Plain greedy cannot fail and, shared, lets mlx-lm sample the batch in one call.
                samplers=[sampler if sampler is greedy else _isolated(seq, sampler, fallback=greedy)],
                logits_processors=[processors],
            )
        except Exception as e:
            logger.exception("could not start a generation")
            self._finish(seq, "error", "", error=public_error("could not start the generation", e))
            return
        seq.uid = uid
        self._active[uid] = seq

    def _drop_failed(self) -> None:
        """End the sequences whose own sampler or processors raised; the rest of the batch goes on."""
        failed = [seq for seq in self._active.values() if seq.failure is not None]
        if failed:
            self._remove(failed)
            for seq in failed:
                logger.error("%s failed: %r", seq.request.id, seq.failure)
                self._finish(seq, "error", "", error=public_error("generation failed", seq.failure))

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.cancel_seen]:
            self._waiting.remove(seq)
            self._end_cancelled(seq, "")
        gone = [seq for seq in self._active.values() if seq.cancel_seen]
        if gone:
            self._remove(gone)
            for seq in gone:
                self._end_cancelled(seq, self._flush(seq))

    def _end_cancelled(self, seq: _Sequence, text: str) -> None:
        if self.cancel_error:
            self._finish(seq, "error", "", error=self.cancel_error)
        else:
            self._finish(seq, "stop", text)

    def _on_token(self, seq: _Sequence, r) -> None:
        seq.generated += 1
        if seq.generated == 1:
            seq.t_first = time.perf_counter()
        if r.finish_reason is not None:
            self._keep_cache(_cache_key(seq.request, r.all_tokens), r.prompt_cache)
        if r.finish_reason == "stop":  # an end-of-sequence token: never shown
            self._finish(seq, "stop", self._flush(seq))
            return
        seq.detokenizer.add_token(r.token)
        if seq.request.logprobs is not None and seq.loop is not None:
            seq.logprobs.append(token_logprob(self.tokenizer, r.logprobs, r.token, seq.request.logprobs))
        text = seq.stop.feed(seq.detokenizer.last_segment)
        if seq.stop.stopped is not None:
            self._remove([seq])
            self._finish(seq, "stop", text)
        elif r.finish_reason == "length":
            self._finish(seq, "length", text + self._flush(seq))
        elif text:
            self._emit(seq, GenerationEvent(text=text, logprobs=_take_logprobs(seq)))

    def _remove(self, seqs: list[_Sequence]) -> None:
        """Take sequences out of the batch before their natural end, keeping their KV caches."""
        by_uid = {s.uid: s for s in seqs}
        caches = self._gen.remove(list(by_uid), return_prompt_caches=self._cache_enabled)
        for uid, (cache, tokens) in caches.items():
            self._keep_cache(_cache_key(by_uid[uid].request, tokens), cache)

    def _keep_cache(self, tokens, cache) -> None:
        if self._cache_enabled and tokens and cache:
            # A cache taken out of the batch is a lazy slice that keeps the whole batch's buffers
            # alive; evaluated, it holds (and the byte cap counts) only this sequence's keys and values.
            mx.eval([a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)])
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
        if seq.loop is None:  # a follower rank's copy: nobody to tell
            return
        logger.info(
            "%s %s: %d prompt tokens (%d cached), %d generated, %.1f tokens/s",
            seq.request.id, why, usage.prompt_tokens, seq.cached, usage.completion_tokens,
            timings.as_dict()["predicted_per_second"],
        )
        # Observers first: a client that has its answer and then scrapes /metrics must see it counted.
        if self.on_finish is not None:
            try:
                self.on_finish(why, usage, timings, (seq.t_start or now) - seq.t_submit)
            except Exception:  # an observer must never stop the engine
                logger.exception("on_finish observer failed")
        self._emit(seq, GenerationEvent(
            text=text, finish_reason=reason, usage=usage, timings=timings, error=error, stop_sequence=seq.stop.stopped,
            logprobs=_take_logprobs(seq),
        ))

    def _fail_all(self, message: str) -> None:
        for seq in list(self._active.values()):
            self._finish(seq, "error", "", error=message)
        self._gen.close()
        mx.clear_cache()
        self._gen = make_batch_generator(self.model, **self._batch_args)

    @staticmethod
    def _emit(seq: _Sequence, event: GenerationEvent) -> None:
        if seq.loop is None:  # a follower rank's copy
            return
        try:
            seq.loop.call_soon_threadsafe(seq.events.put_nowait, event)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


def _cache_key(request: GenerationRequest, tokens) -> list[int]:
    """What the prompt cache files a sequence's tokens under: the tokens themselves, except that
    an image prompt's image tokens stand for the images' content (engine/vision.py)."""
    tokens = list(tokens)
    if request.vision is None:
        return tokens
    key = request.vision.cache_key
    return key[: len(tokens)] + tokens[len(key):]


def _take_logprobs(seq: _Sequence) -> list[TokenLogprob] | None:
    """The logprobs of the tokens behind an event's text (None when the request did not ask)."""
    if seq.request.logprobs is None:
        return None
    out, seq.logprobs = seq.logprobs, []
    return out


def _detokenizer(tokenizer, request: GenerationRequest):
    """A fresh detokenizer for one sequence. mlx-lm's drop the first token's leading space (a word
    boundary at the start of a text); a continuation keeps it: `is` + ` Paris`, not `isParis`."""
    detokenizer = copy.copy(tokenizer.detokenizer)
    detokenizer.reset()
    if request.continues_text:
        detokenizer.trim_space = False  # SPMStreamingDetokenizer
        detokenizer._maybe_trim_space = lambda text: text  # BPEStreamingDetokenizer
    return detokenizer


def _isolated(seq: _Sequence, fn, fallback):
    """`fn` as a per-sequence callable of the batch step: if it raises, the sequence is marked
    failed and `fallback` answers instead, so one request's bad sampling cannot fail the batch."""

    def call(*args):
        if seq.failure is None:
            try:
                return fn(*args)
            except Exception as e:
                seq.failure = e
        return fallback(*args)

    return call


def public_error(what: str, e: Exception) -> str:
    """An engine failure as clients see it: what happened, never paths or internals (those are logged)."""
    text = str(e).lower()
    if any(w in text for w in ("out of memory", "failed to allocate", "insufficient memory", "unable to allocate")):
        return f"{what}: out of memory; retry with a shorter prompt or fewer concurrent requests"
    return f"{what} ({type(e).__name__}); see the server log"


_WAKE = object()
_MODEL_KEY = "model"  # one model per process; mlx-lm's cache can hold several
