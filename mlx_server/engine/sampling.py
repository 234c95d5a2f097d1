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
from mlx_server.engine.request import SamplingParams, TokenLogprob

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
    """Logit bias and repetition/presence/frequency penalties; none when all are neutral."""
    window = min(p.repetition_context_size, MAX_WINDOW)
    return make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=p.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=window,
    )


def token_logprob(tokenizer, logprobs: mx.array, token: int, n_top: int) -> TokenLogprob:
    """The sampled token's log probability and the `n_top` most likely tokens at its position."""
    top = []
    if n_top:
        k = min(n_top, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        pairs = sorted(zip(ids.tolist(), logprobs[ids].tolist()), key=lambda p: -p[1])
        top = [(token_bytes(tokenizer, i), v) for i, v in pairs]
    return TokenLogprob(token_bytes(tokenizer, token), logprobs[token].item(), top)
