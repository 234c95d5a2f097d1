"""Anthropic Messages request schemas (responses are built as plain dicts).

Unknown fields (`metadata`, `cache_control`, `service_tier`...) are accepted and ignored;
`null` for an optional field means its default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mlx_server.api.schema import Lenient, by_type


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageSource(Lenient):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self):
        needed = ("media_type", "data") if self.type == "base64" else ("url",)
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} image source needs {' and '.join(missing)}")
        return self


class ImageBlock(Lenient):
    type: Literal["image"]
    source: ImageSource


class DocumentBlock(Lenient):
    type: Literal["document"]
    source: dict


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[by_type(TextBlock, ImageBlock, DocumentBlock)] | None = None
    is_error: bool | None = None


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = by_type(TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock)


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search...) are not ours to run


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's name")
        return self


class ThinkingConfig(Lenient):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return self


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(Lenient):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    # The 2.x SDK sends these through extra_body; Anthropic's own ranges.
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        if self.thinking and self.thinking.type == "enabled" and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("`max_tokens` must be greater than `thinking.budget_tokens`")
        return self
