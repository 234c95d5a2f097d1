"""Faults inside the batch: one sequence whose own sampling fails ends alone, with an error that
names no internals, while the sequences batched with it complete unchanged."""

from __future__ import annotations

import asyncio

import pytest

from mlx_server.engine import scheduler
from mlx_server.engine.request import GenerationRequest, SamplingParams

FAULTY_SEED = 666


@pytest.fixture
def engine(tiny_model_dir, monkeypatch):
    """An engine where a request with FAULTY_SEED gets a logits processor that raises at its third token."""
    from mlx_server.engine.loader import load_model

    real = scheduler.make_processors

    def with_fault(params: SamplingParams) -> list:
        processors = real(params)
        if params.seed == FAULTY_SEED:
            calls = []

            def explode(tokens, logits):
                calls.append(1)
                if len(calls) >= 3:
                    raise RuntimeError("cannot read /Users/someone/secret/weights.safetensors")
                return logits

            processors.append(explode)
        return processors

    monkeypatch.setattr(scheduler, "make_processors", with_fault)
    loaded = load_model(tiny_model_dir)
    engine = scheduler.Engine(loaded.model, loaded.tokenizer)
    engine.start()
    yield engine
    engine.stop()


def request(engine, rid: str, prompt: str, seed: int | None = None) -> GenerationRequest:
    tokens = engine.tokenizer.encode(prompt, add_special_tokens=False)
    bias = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    return GenerationRequest(rid, tokens, 20, SamplingParams(temperature=0, logit_bias=bias, seed=seed))


async def collect(handle) -> tuple[str, object]:
    text = []
    async for event in handle.events():
        text.append(event.text)
    return "".join(text), event


def test_a_sequence_whose_sampling_raises_ends_alone_and_its_batch_completes(engine):
    prompts = ["Tell me about the sea.", "What is a cat?"]

    async def alone():
        return [await collect(engine.submit(request(engine, f"alone-{i}", p))) for i, p in enumerate(prompts)]

    async def together():
        handles = [engine.submit(request(engine, f"batch-{i}", p)) for i, p in enumerate(prompts)]
        handles.insert(1, engine.submit(request(engine, "faulty", "Count to five.", seed=FAULTY_SEED)))
        return await asyncio.gather(*(collect(h) for h in handles))

    expected = asyncio.run(alone())
    first, (_, faulty), second = asyncio.run(together())
    assert faulty.finish_reason == "error"
    assert "RuntimeError" in faulty.error and "/Users" not in faulty.error
    for (text, event), (want, _) in zip((first, second), expected):
        assert event.finish_reason == "length" and event.usage.completion_tokens == 20
        assert text == want
