"""Constrained decoding with llguidance: one grammar per request, applied as a logits processor.

llguidance says which tokens may come next as a bitmask. Its own `llguidance.mlx` applies the
mask with a Metal kernel ("No Metal back-end" on CPU and CUDA), so it is applied here with
portable mx ops. The same llguidance tokenizer also gives each token's bytes (for logprobs).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_server.log import logger

_lock = threading.Lock()
_tokenizers: "weakref.WeakKeyDictionary[object, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer; built once per tokenizer (0.3 s for 49k tokens, 3 s for 152k)."""
    with _lock:
        ll = _tokenizers.get(tokenizer)
        if ll is None:
            hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
            ll = llguidance.hf.from_tokenizer(hf, eos_token=sorted(tokenizer.eos_token_ids))
            _tokenizers[tokenizer] = ll
        return ll


def grammar_error(tokenizer, grammar: str) -> str | None:
    """Why llguidance cannot use this grammar (e.g. an unsupported JSON Schema keyword), or None."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer))
    return messages[0] if is_error else None


def special_token(tokenizer, text: str) -> int | None:
    """The id of `text` when it is a single special token, which grammars must name as a token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ll_tokenizer(tokenizer).is_special_token(ids[0]):
        return ids[0]
    return None


def token_bytes(tokenizer, token: int) -> bytes:
    return ll_tokenizer(tokenizer).decode_bytes([token])


class GrammarProcessor:
    """An mlx-lm logits processor `(tokens, logits) -> logits` that allows only what the grammar allows.

    It must see every token the sequence samples: wrap the sequence's sampler with `sampler`.
    Reading the token that sampler returned (rather than mlx-lm's token context, which is
    queued behind the batch's forward pass) lets every sequence's mask be computed while the
    forward pass already runs.
    """

    def __init__(self, tokenizer, grammar: str):
        ll = ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        self.bitmask = allocate_token_bitmask(1, ll.vocab_size)
        self._sampled: mx.array | None = None  # the previous step's token, not yet consumed
        self.broken = False

    def sampler(self, sample: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        def sample_and_remember(logprobs: mx.array) -> mx.array:
            self._sampled = sample(logprobs)
            return self._sampled

        return sample_and_remember

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Start this step's forward pass now, so it runs while the mask is computed.
        mx.async_eval(logits)
        if self._sampled is not None:
            self.matcher.consume_token(self._sampled.item())
            self._sampled = None
        if self.matcher.is_error():
            if not self.broken:
                self.broken = True
                logger.warning("constrained decoding stopped constraining: %s", self.matcher.get_error())
            return logits
        fill_next_token_bitmask(self.matcher, self.bitmask)
        return apply_bitmask(logits, self.bitmask[0])


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """-inf where bit i of the int32 words is 0 (token i is not allowed), with numpy and mx.where:
    any device. Tokens past the mask (models pad their vocabulary) are not allowed."""
    width = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:width]
    allowed = np.zeros(width, dtype=bool)
    allowed[: len(bits)] = bits
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))
