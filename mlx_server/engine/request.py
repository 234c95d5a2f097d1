"""The one internal request type and event stream shared by every protocol."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_server.text.chat_output import OutputConfig


@dataclass
class ThinkingBudget:
    """Reasoning may go on for at most `tokens` generated tokens; then its end marker is forced
    (engine/sampling.py's ReasoningBudget). The markers are token ids."""

    tokens: int
    start: list[int]
    end: list[int]
    starts_inside: bool = False  # the prompt opened the reasoning block (the output starts in it)


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    thinking_budget: ThinkingBudget | None = None


@dataclass
class GenerationRequest:
    id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None  # an llguidance grammar (api/output.py) the output must follow
    logprobs: int | None = None  # None: off; n: each token's logprob and its n most likely alternatives
    # How the protocol reads the generated text (ChatOutput(request.output)); the engine ignores it.
    output: OutputConfig = field(default_factory=OutputConfig)
    # The prompt ends inside a text the output continues (an assistant prefill, a raw completion):
    # the first token's leading space is kept (mlx-lm's detokenizers drop it at the start of a text).
    continues_text: bool = False
    # An image prompt (engine/vision.py's VisionInput): pixels, and where their features go in prompt_tokens.
    vision: object | None = None


@dataclass
class Timings:
    """llama.cpp's `timings` object (Jan's UI reads it); times in milliseconds."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0

    def as_dict(self) -> dict:
        def per(n, ms):
            return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)

        prompt_per_token_ms, prompt_per_second = per(self.prompt_n, self.prompt_ms)
        # predicted_ms runs from the first token to the last: it spans predicted_n - 1 decode steps
        # (the first token's time is part of prompt_ms).
        predicted_per_token_ms, predicted_per_second = per(max(self.predicted_n - 1, 0), self.predicted_ms)
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
            "cache_n": self.cache_n,
        }


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class TokenLogprob:
    """One generated token's log probability, and the most likely tokens at its position."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]] = field(default_factory=list)


@dataclass
class GenerationEvent:
    """One step of a generation: new text, and on the last event why it ended and the usage.

    `finish_reason` is `stop` (EOS, a stop string, or a cancellation), `length` (max_tokens
    or the context window) or `error` (then `error` says what went wrong); `stop_sequence`
    is the stop string that ended it, if one did (Anthropic reports it).
    """

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # the tokens generated since the last event, when asked
    stop_sequence: str | None = None
