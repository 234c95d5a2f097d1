"""OpenAI legacy Completions request schema (responses are built as plain dicts)."""

from __future__ import annotations

from pydantic import Field

from mlx_server.api.openai.protocol import GenerationFields


class CompletionRequest(GenerationFields):
    model: str
    # A string, strings (one choice each), token ids, or lists of token ids (one choice each).
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=1)
    # Each generated token's logprob and its `logprobs` most likely alternatives (OpenAI's limit: 5);
    # not with `echo`, whose prompt logprobs would need a scoring pass the engine does not have.
    logprobs: int | None = Field(None, ge=0, le=5)
