"""The thinking budget's logits processor, step by step: what it lets the model write, what it forces."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlx_server.engine.request import SamplingParams, ThinkingBudget
from mlx_server.engine.sampling import ReasoningBudget, make_processors

V = 20
PROMPT = [1, 2, 3]
START, END = 10, 11  # one-token markers, as Qwen3's <think> and </think>
A, B, C = 5, 6, 7  # ordinary text


def generate(budget: ThinkingBudget, wanted: list[int]) -> tuple[list[int], list[bool]]:
    """Decode as mlx-lm does: the processor sees the tokens so far and the logits; at step i the model
    picks `wanted[i]`, unless the processor allowed only one token. The tokens, and which were forced."""
    processor = ReasoningBudget(budget)
    tokens, forced = list(PROMPT), []
    for want in wanted:
        logits = processor(mx.array(tokens), mx.zeros((1, V)))
        allowed = [i for i, x in enumerate(logits[0].tolist()) if x != -math.inf]
        forced.append(len(allowed) == 1)
        tokens.append(allowed[0] if len(allowed) == 1 else want)
    return tokens[len(PROMPT):], forced


def test_reasoning_is_closed_after_the_budget_and_the_answer_follows():
    out, forced = generate(ThinkingBudget(3, [START], [END]), [START, A, A, A, A, B, C])
    assert out == [START, A, A, A, END, B, C]
    assert forced == [False, False, False, False, True, False, False]


@pytest.mark.parametrize("budget", [1, 2, 5])
def test_at_most_budget_tokens_inside_for_every_budget(budget):
    out, forced = generate(ThinkingBudget(budget, [START], [END]), [START] + [A] * (budget + 3))
    assert out[: budget + 2] == [START] + [A] * budget + [END]
    assert forced.count(True) == 1


def test_a_model_that_closes_in_time_is_never_touched():
    wanted = [START, A, B, END, C, C, C, C, C]
    out, forced = generate(ThinkingBudget(3, [START], [END]), wanted)
    assert out == wanted and not any(forced)


def test_closing_right_after_the_last_token_of_the_budget_is_what_the_model_wrote():
    wanted = [START, A, B, C, END, C]
    out, forced = generate(ThinkingBudget(3, [START], [END]), wanted)
    assert out == wanted and forced.count(True) == 1


def test_a_model_that_never_opens_reasoning_is_never_touched():
    wanted = [A] * 12
    out, forced = generate(ThinkingBudget(2, [START], [END]), wanted)
    assert out == wanted and not any(forced)


def test_text_before_the_opening_marker_does_not_count():
    out, forced = generate(ThinkingBudget(2, [START], [END]), [A, B, C, START, A, A, A, C])
    assert out == [A, B, C, START, A, A, END, C]
    assert forced.index(True) == 6


def test_a_prompt_that_opened_reasoning_counts_from_the_first_token():
    out, forced = generate(ThinkingBudget(2, [START], [END], starts_inside=True), [A] * 5)
    assert out == [A, A, END, A, A]
    assert forced == [False, False, True, False, False]


def test_a_second_opening_marker_after_the_close_is_not_limited():
    wanted = [START, A, END, START, A, A, A, A]
    out, forced = generate(ThinkingBudget(2, [START], [END]), wanted)
    assert out == wanted and not any(forced)


def test_a_marker_of_several_tokens_is_forced_token_by_token():
    start, end = [12, 13], [14, 15, 16]
    out, forced = generate(ThinkingBudget(2, start, end), start + [A] * 7)
    assert out == start + [A, A] + end + [A, A]
    assert forced == [False, False, False, False, True, True, True, False, False]


def test_a_marker_the_model_had_begun_is_completed_not_repeated():
    end = [14, 15, 16]
    out, forced = generate(ThinkingBudget(2, [START], end), [START, A, 14, A, A, A])
    assert out == [START, A, 14, 15, 16, A]
    assert forced == [False, False, False, True, True, False]


def test_a_partial_opening_marker_is_not_an_opening():
    start = [12, 13]
    wanted = [12, A, A, A, A, A, A]
    out, forced = generate(ThinkingBudget(1, start, [END]), wanted)
    assert out == wanted and not any(forced)


def test_the_forced_token_is_the_only_possible_one_whatever_its_logit():
    processor = ReasoningBudget(ThinkingBudget(1, [START], [END], starts_inside=True))
    processor(mx.array(PROMPT), mx.zeros((1, V)))
    logits = mx.full((1, V), 5.0)
    logits[0, END] = -50.0
    out = processor(mx.array(PROMPT + [A]), logits)[0].tolist()
    assert out[END] == 0.0 and all(x == -math.inf for i, x in enumerate(out) if i != END)


def test_make_processors_adds_the_budget_last_and_only_when_asked():
    assert make_processors(SamplingParams()) == []
    budget = ThinkingBudget(4, [START], [END])
    processors = make_processors(SamplingParams(logit_bias={1: 2.0}, thinking_budget=budget))
    assert len(processors) == 2 and isinstance(processors[-1], ReasoningBudget)
