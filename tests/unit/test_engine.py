"""The scheduler in-process: cancellation takes effect within a token; a bad step fails only cleanly."""

from __future__ import annotations

import asyncio

import pytest

from mlx_server.engine.request import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from mlx_server.engine.loader import load_model
    from mlx_server.engine.scheduler import Engine

    loaded = load_model(tiny_model_dir)
    e = Engine(loaded.model, loaded.tokenizer)
    e.start()
    yield e
    e.stop()


def request(engine, rid, max_tokens=500):
    tokens = engine.tokenizer.encode("Hello there, tell me a story", add_special_tokens=False)
    bias = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    return GenerationRequest(rid, tokens, max_tokens, SamplingParams(temperature=0, logit_bias=bias))


def test_cancel_stops_generation_within_a_token(engine):
    async def main():
        handle = engine.submit(request(engine, "a"))
        events = handle.events()
        for _ in range(3):
            await events.__anext__()
        handle.cancel()
        return [e async for e in events]

    after = asyncio.run(main())
    assert after[-1].finish_reason == "stop"
    # The engine checks the flag before every step; one step may already be in flight.
    assert after[-1].usage.completion_tokens <= 3 + 2
    assert engine.active_count == 0


def test_max_tokens_is_exact_and_usage_counts_tokens(engine):
    async def main():
        return [e async for e in engine.submit(request(engine, "b", max_tokens=7)).events()]

    events = asyncio.run(main())
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 7
    assert events[-1].timings.predicted_n == 7


def test_cancel_all_counts_live_generations(engine):
    async def main():
        handles = [engine.submit(request(engine, f"c{i}")) for i in range(3)]
        for h in handles:  # every one is running before the cancel
            await h.events().__anext__()
        n = engine.cancel_all()
        ends = []
        for h in handles:
            ends.append([e async for e in h.events()][-1])
        return n, ends

    n, ends = asyncio.run(main())
    assert n == 3
    assert all(e.finish_reason == "stop" for e in ends)


def test_a_continuation_keeps_the_leading_space_of_its_first_token(tiny_model_dir):
    from mlx_lm.utils import load_tokenizer

    from mlx_server.engine.scheduler import _detokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(" Paris is", add_special_tokens=False)

    def text(continues_text: bool) -> str:
        detokenizer = _detokenizer(tokenizer, GenerationRequest("x", [1], 1, continues_text=continues_text))
        for i in ids:
            detokenizer.add_token(i)
        detokenizer.finalize()
        return detokenizer.text

    assert text(True) == " Paris is"
    assert text(False) == "Paris is"  # the start of an answer: mlx-lm's word-boundary space is dropped
    assert tokenizer.detokenizer._maybe_trim_space(" a") == "a"  # the shared detokenizer is untouched
