"""OpenAI legacy completions: each prompt (no chat template) becomes a GenerationRequest; engine
events become `text_completion` objects or SSE chunks, one choice per prompt."""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import time

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from mlx_server.api.completions.protocol import CompletionRequest
from mlx_server.api.errors import APIError
from mlx_server.api.limits import check_count
from mlx_server.api.openai.serving import ChatServing, submit
from mlx_server.api.sse import DONE, SSE_HEADERS, data_frame, on_disconnect
from mlx_server.engine.request import GenerationEvent, GenerationRequest, TokenLogprob
from mlx_server.engine.scheduler import GenerationHandle

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_PROMPTS = 128  # each is a generation of its own
# Fill-in-the-middle markers (prefix, suffix, middle) of the model families that have them,
# in prefix-suffix-middle order: StarCoder and SmolLM, Qwen2.5-Coder, DeepSeek-Coder.
FIM_MARKERS = [
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
]


class CompletionServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.tokenizer = chat.engine.tokenizer
        self.fim = fim_markers(self.tokenizer.get_vocab())

    # ---- request translation ----

    def prompts(self, req: CompletionRequest) -> list[tuple[str, list[int]]]:
        """Each prompt as (its text, for echo; its tokens); a raw prompt gets the model's BOS as usual."""
        raw = req.prompt
        if isinstance(raw, list) and not raw:
            raise APIError(400, "prompt: must not be an empty list", param="prompt")
        if isinstance(raw, str) or isinstance(raw[0], int):
            raw = [raw]
        check_count(raw, MAX_PROMPTS, "prompt", "prompts")
        out = []
        for i, p in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                text = p
                if req.suffix:
                    text = self.fill_in_the_middle(p, req.suffix)
                tokens = self.tokenizer.encode(text)
            else:
                if not p:
                    raise APIError(400, f"{where}: a token list must not be empty", param=where)
                bad = [t for t in p if not 0 <= t < self.chat.prompt.vocab_size]
                if bad:
                    raise APIError(400, f"{where}: {bad[0]} is not a token id of this model (0..{self.chat.prompt.vocab_size - 1})",
                                   param=where)
                text = self.tokenizer.decode(p)
                tokens = self.tokenizer.encode(self.fill_in_the_middle(text, req.suffix)) if req.suffix else list(p)
            if not tokens:  # OpenAI's default prompt is a document boundary
                tokens = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id]
            out.append((p if isinstance(p, str) else text, tokens))
        return out

    def fill_in_the_middle(self, prefix: str, suffix: str) -> str:
        if self.fim is None:
            raise APIError(400, "suffix: this model has no fill-in-the-middle tokens (such as <fim_prefix>), so it cannot "
                                "complete between a prompt and a suffix; leave suffix out", param="suffix")
        pre, suf, mid = self.fim
        return f"{pre}{prefix}{suf}{suffix}{mid}"

    def build_requests(self, req: CompletionRequest, completion_id: str) -> list[tuple[GenerationRequest, str, str]]:
        """One GenerationRequest per prompt, with its prompt text and the text `echo` puts before its completion."""
        if req.echo and req.logprobs is not None:
            raise APIError(400, "logprobs: not supported with echo (the prompt tokens' logprobs would need a scoring "
                                "pass this server does not have); leave one of them out", param="logprobs")
        requested = req.max_tokens
        if requested is None:
            requested = None if req.n_predict == -1 else req.n_predict or DEFAULT_MAX_TOKENS
        sampling = self.chat.sampling_params(req)
        stop = self.chat.prompt.stop_strings(req.stop)
        out = []
        for i, (text, tokens) in enumerate(self.prompts(req)):
            gen = GenerationRequest(
                id=completion_id if i == 0 else f"{completion_id}-{i}",
                prompt_tokens=tokens,
                max_tokens=self.chat.prompt.completion_budget(len(tokens), requested, param="prompt"),
                sampling=sampling,
                stop=stop,
                logprobs=req.logprobs,
                continues_text=True,  # a raw prompt is text the completion goes on with
            )
            out.append((gen, text, text if req.echo else ""))
        return out

    # ---- responses ----

    async def create(self, req: CompletionRequest, request: Request):
        completion_id = "cmpl-" + secrets.token_hex(12)
        built = await asyncio.to_thread(self.build_requests, req, completion_id)
        handles: list[GenerationHandle] = []
        try:
            for gen, _, _ in built:
                handles.append(submit(self.chat.engine, gen))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        meta = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": req.model}
        echoes = [echo for _, _, echo in built]
        # OpenAI counts text_offset from the prompt's start, echoed or not.
        logprobs = [LegacyLogprobs(len(prompt)) if req.logprobs is not None else None for _, prompt, _ in built]
        if req.stream:
            stream = self._stream(handles, echoes, logprobs, meta, request)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        return await self._complete(handles, echoes, logprobs, meta, request)

    async def _complete(self, handles: list[GenerationHandle], echoes: list[str], logprobs: list[LegacyLogprobs | None],
                        meta: dict, request: Request):
        watcher = on_disconnect(request, lambda: [h.cancel() for h in handles])
        try:
            results = await asyncio.gather(*(collect(h) for h in handles))
        finally:
            watcher.cancel()
        for _, _, event in results:
            if event.finish_reason == "error":
                raise APIError(503, event.error or "generation failed", type="server_error", code="generation_failed")
        choices = [
            {"index": i, "text": echoes[i] + text, "logprobs": logprobs[i].feed(text, entries) if logprobs[i] else None,
             "finish_reason": event.finish_reason}
            for i, (text, entries, event) in enumerate(results)
        ]
        body = {**meta, "choices": choices, "usage": usage_dict([e for _, _, e in results])}
        if len(results) == 1:
            body["timings"] = results[0][2].timings.as_dict()
        return JSONResponse(body)

    async def _stream(self, handles: list[GenerationHandle], echoes: list[str], logprobs: list[LegacyLogprobs | None],
                      meta: dict, request: Request):
        """Every prompt's chunks as they come; the last chunk carries the usage of them all."""
        watcher = on_disconnect(request, lambda: [h.cancel() for h in handles])
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: GenerationHandle):
            async for event in handle.events():
                events.put_nowait((i, event))

        def chunk(i: int, text: str, finish_reason=None, entries=None, **extra) -> bytes:
            choice = {"index": i, "text": text, "logprobs": logprobs[i].feed(text, entries) if logprobs[i] else None,
                      "finish_reason": finish_reason}
            return data_frame({**meta, "choices": [choice], **extra})

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        finals: list[GenerationEvent] = []
        try:
            for i, echo in enumerate(echoes):
                if echo:
                    yield chunk(i, echo)
            while len(finals) < len(handles):
                i, event = await events.get()
                if event.finish_reason == "error":
                    error = {"message": event.error, "type": "server_error", "param": None, "code": "generation_failed"}
                    yield b"error: " + json.dumps({"message": event.error}).encode() + b"\n\n"
                    yield data_frame({"error": error})
                    return
                if event.finish_reason is None:
                    if event.text:
                        yield chunk(i, event.text, entries=event.logprobs)
                    continue
                finals.append(event)
                extra = {}
                if len(finals) == len(handles):
                    extra["usage"] = usage_dict(finals)
                    if len(handles) == 1:
                        extra["timings"] = event.timings.as_dict()
                yield chunk(i, event.text, event.finish_reason, entries=event.logprobs, **extra)
            yield DONE
        finally:
            watcher.cancel()
            for task in pumps:
                task.cancel()
            for h in handles:
                h.cancel()


async def collect(handle: GenerationHandle) -> tuple[str, list[TokenLogprob], GenerationEvent]:
    """A generation's whole text, its tokens' logprobs (when asked) and its last event."""
    parts, entries = [], []
    async for event in handle.events():
        parts.append(event.text)
        entries += event.logprobs or []
    return "".join(parts), entries, event


class LegacyLogprobs:
    """One choice's legacy `logprobs` objects (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`),
    following its text: each piece of text carries the tokens that start in it. Tokens that start after
    the text's end (a stop string's, which is never shown) are never sent."""

    def __init__(self, start: int):
        self.offset = start  # where the next token starts, in characters from the prompt's start
        self.end = start  # where the text sent so far ends
        self.pending: list[tuple[int, TokenLogprob]] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split over tokens counts once

    def feed(self, text: str, entries: list[TokenLogprob] | None) -> dict:
        for e in entries or []:
            self.pending.append((self.offset, e))
            self.offset += len(self.decoder.decode(e.token))
        self.end += len(text)
        n = sum(1 for offset, _ in self.pending if offset < self.end)
        ready, self.pending = self.pending[:n], self.pending[n:]
        return {
            "tokens": [token_text(e.token) for _, e in ready],
            "token_logprobs": [clamp(e.logprob) for _, e in ready],
            # OpenAI's: the sampled token is always among them (so up to `logprobs` + 1 entries).
            "top_logprobs": [top_dict(e) for _, e in ready],
            "text_offset": [offset for offset, _ in ready],
        }


def top_dict(e: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for token, logprob in [*e.top, (e.token, e.logprob)]:
        top.setdefault(token_text(token), clamp(logprob))
    return top


def token_text(token: bytes) -> str:
    """A token as text; one that is not whole UTF-8 (part of a character) as `bytes:\\xe2\\x80`, OpenAI's way."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


def clamp(logprob: float) -> float:
    """-9999.0 stands for a probability too small to write (OpenAI's convention; JSON has no -inf)."""
    return max(logprob, -9999.0)


def usage_dict(finals: list[GenerationEvent]) -> dict:
    prompt = sum(e.usage.prompt_tokens for e in finals)
    completion = sum(e.usage.completion_tokens for e in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fim_markers(vocab: dict) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle marker tokens, if its vocabulary has a known set."""
    for markers in FIM_MARKERS:
        if all(m in vocab for m in markers):
            return markers
    return None
