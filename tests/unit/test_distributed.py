"""Pieces of the distributed mode that need no second process: the layer split, the wire form of a
request, the token checksum, and what a failed group does to live and new generations."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_server.engine.distributed import pipeline_split, request_from_wire, request_to_wire, token_checksum
from mlx_server.engine.request import GenerationRequest, SamplingParams, ThinkingBudget


@given(st.integers(1, 200), st.integers(1, 16))
def test_pipeline_split_covers_every_layer_once_in_order(n_layers, size):
    if size > n_layers:
        return
    spans = [pipeline_split(n_layers, size, rank) for rank in range(size)]
    # Rank size-1 runs the first layers, rank 0 the last; together they cover 0..n-1 once.
    ordered = sorted(spans)
    assert ordered[0][0] == 0 and ordered[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in zip(ordered, ordered[1:]))
    assert spans[0][1] == n_layers and spans[-1][0] == 0
    counts = [end - start for start, end in spans]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1


def test_request_survives_the_wire():
    req = GenerationRequest(
        "chatcmpl-1", [1, 2, 3], 17,
        SamplingParams(temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, repetition_penalty=1.1, logit_bias={5: -3.5, 7: 2.0}, seed=-12,
                       thinking_budget=ThinkingBudget(8, [11], [12, 13], starts_inside=True)),
        stop=["\n\n", "END"], grammar='start: "a"', logprobs=3, continues_text=True,
    )
    import json

    back = request_from_wire(json.loads(json.dumps(request_to_wire(req))))
    for field in ("id", "prompt_tokens", "max_tokens", "sampling", "stop", "grammar", "logprobs", "continues_text"):
        assert getattr(back, field) == getattr(req, field), field


class R:
    def __init__(self, uid, token):
        self.uid, self.token = uid, token


def test_token_checksum_sees_any_difference():
    base = [R(0, 10), R(1, 20)]
    assert token_checksum(base) == token_checksum([R(0, 10), R(1, 20)])
    assert token_checksum(base) != token_checksum([R(0, 10), R(1, 21)])
    assert token_checksum(base) != token_checksum([R(1, 10), R(0, 20)])
    assert token_checksum([]) == 0


@pytest.fixture
def engine(tiny_model_dir):
    from mlx_server.engine.loader import load_model
    from mlx_server.engine.scheduler import Engine

    loaded = load_model(tiny_model_dir)
    e = Engine(loaded.model, loaded.tokenizer)
    e.start()
    yield e
    e.stop()


def test_a_failed_group_ends_live_generations_with_an_error_and_refuses_new_ones(engine):
    from mlx_server.engine.scheduler import EngineUnavailable

    tokens = engine.tokenizer.encode("Tell me a story", add_special_tokens=False)
    bias = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    failures = []
    engine.on_group_failure = lambda: failures.append(True)

    async def main():
        handle = engine.submit(GenerationRequest("g", tokens, 500, SamplingParams(temperature=0, logit_bias=bias)))
        events = handle.events()
        await events.__anext__()
        engine.fail_group("the model's distributed group failed: rank 1 is gone")
        rest = [e async for e in events]
        with pytest.raises(EngineUnavailable, match="rank 1 is gone"):
            engine.submit(GenerationRequest("h", tokens, 5, SamplingParams(temperature=0)))
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finish_reason == "error"
    assert "rank 1 is gone" in rest[-1].error
    assert failures == [True]
    engine.fail_group("again")  # only the first failure counts
    assert failures == [True] and "rank 1 is gone" in engine.failed
