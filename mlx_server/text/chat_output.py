"""Generated text -> what the assistant said: content, reasoning and tool calls (feed/finish).

One ChatOutput per request, shared by every protocol: OpenAI chat turns its deltas into
`delta.content` / `delta.reasoning_content` / `delta.tool_calls`, Anthropic into text,
thinking and tool_use blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    index: int  # 0, 1, 2... in the order the calls were generated
    id: str | None = None  # set on a call's first delta
    name: str | None = None  # set on a call's first delta
    arguments: str = ""  # the next fragment of the call's JSON arguments text


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass
class OutputConfig:
    """How to read one request's output; built from its rendered prompt and options."""

    starts_in_reasoning: bool = False


class ChatOutput:
    def __init__(self, config: OutputConfig | None = None):
        self.config = config or OutputConfig()
        self.tool_calls_seen = 0

    def feed(self, text: str) -> OutputDelta:
        return OutputDelta(content=text)

    def finish(self) -> OutputDelta:
        return OutputDelta()
