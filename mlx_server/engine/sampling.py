"""Per-request samplers and logits processors, built from mlx-lm's sampling pieces."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from mlx_server.engine.guidance import token_bytes
from mlx_server.engine.request import SamplingParams, ThinkingBudget, TokenLogprob

Sampler = Callable[[mx.array], mx.array]
# MLX slices take 32-bit indices; a penalty window past any context means the whole context.
MAX_WINDOW = 2**31 - 1


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(p: SamplingParams) -> Sampler:
    """Temperature 0 is greedy; otherwise top-p/min-p/top-k filtering, then a categorical draw.

    mlx-lm's own sampler draws from the global RNG; a per-request `seed` needs a key of its
    own, so the draw is ours and the filters are mlx-lm's.
    """
    if p.temperature == 0:
        return greedy
    filters = []
    if 0 < p.top_p < 1:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0:
        filters.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        # A k beyond the vocabulary keeps every token (mlx-lm's would fail the whole batch's step).
        filters.append(lambda x: apply_top_k(x, p.top_k) if p.top_k < x.shape[-1] else x)
    inv_temp = 1.0 / p.temperature
    # MLX keys are unsigned 64-bit; any integer seed (negative, huge) maps onto one.
    key = [mx.random.key(p.seed % (1 << 64))] if p.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sample


def make_processors(p: SamplingParams) -> list:
    """Logit bias, repetition/presence/frequency penalties, then the thinking budget; none when all are neutral."""
    window = min(p.repetition_context_size, MAX_WINDOW)
    processors = make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=p.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=window,
    )
    if p.thinking_budget is not None:
        processors.append(ReasoningBudget(p.thinking_budget))
    return processors


class ReasoningBudget:
    """An mlx-lm logits processor `(tokens, logits) -> logits` that ends reasoning once it has used its
    budget: when `budget.tokens` tokens were generated inside the block, the end marker's tokens are
    forced, one per step, and the model goes on with its answer.

    The markers are recognised in the generated tokens; they do not count against the budget. A
    model that closes its reasoning in time, or never opens it, is left alone.
    """

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.inside = budget.starts_inside
        self.closed = False
        self.used = 0  # tokens generated inside the reasoning block
        self._steps = 0
        self._recent: list[int] = []  # the last few generated tokens, enough to hold a marker

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self._steps += 1
        if self.closed:
            return logits
        if self._steps > 1:  # `tokens` ends with the previous step's token (at the first step, the prompt's)
            mx.async_eval(logits)  # this step's forward pass runs while the token is read
            self._see(tokens[-1].item())
        if self.closed or not self.inside or self.used < self.budget.tokens:
            return logits
        forced = self.budget.end[_partial_match(self._recent, self.budget.end)]
        only = mx.arange(logits.shape[-1]) == forced
        return mx.where(only, mx.zeros_like(logits), mx.array(-mx.inf, dtype=logits.dtype))

    def _see(self, token: int) -> None:
        start, end = self.budget.start, self.budget.end
        self._recent = (self._recent + [token])[-max(len(start), len(end)):]
        if not self.inside:
            if self._recent[-len(start):] == start:
                self.inside, self._recent = True, []
        elif self._recent[-len(end):] == end:
            self.closed = True
        else:
            self.used += 1


def _partial_match(recent: list[int], marker: list[int]) -> int:
    """How many of `marker`'s first tokens `recent` already ends with (fewer than all of them)."""
    for k in range(min(len(recent), len(marker) - 1), 0, -1):
        if recent[-k:] == marker[:k]:
            return k
    return 0


def token_logprob(tokenizer, logprobs: mx.array, token: int, n_top: int) -> TokenLogprob:
    """The sampled token's log probability and the `n_top` most likely tokens at its position."""
    top = []
    if n_top:
        k = min(n_top, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        pairs = sorted(zip(ids.tolist(), logprobs[ids].tolist()), key=lambda p: -p[1])
        top = [(token_bytes(tokenizer, i), v) for i, v in pairs]
    return TokenLogprob(token_bytes(tokenizer, token), logprobs[token].item(), top)
