"""Generated text -> what the assistant said: content, reasoning and tool calls (feed/finish).

One ChatOutput per request, shared by every protocol: OpenAI chat turns its deltas into
`delta.content` / `delta.reasoning_content` / `delta.tool_calls`, Anthropic into text,
thinking and tool_use blocks. The text goes through the reasoning split first, then the
content through the tool-call parser (a call written inside reasoning stays reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_server.text.reasoning import ReasoningSplitter
from mlx_server.text.tool_calls import ToolCallDelta, ToolCallParser, ToolFormat

__all__ = ["ChatOutput", "OutputConfig", "OutputDelta", "ToolCallDelta"]


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, other: "OutputDelta") -> "OutputDelta":
        return OutputDelta(
            self.content + other.content, self.reasoning + other.reasoning, self.tool_calls + other.tool_calls
        )


@dataclass
class OutputConfig:
    """How to read one request's output; built from its rendered prompt and options (api/output.py)."""

    starts_in_reasoning: bool = False
    # The model's reasoning markers, e.g. ("<think>", "</think>"); None leaves reasoning inline.
    reasoning_markers: tuple[str, str] | None = None
    # The model's tool-call format; None when the request has no tools (or tool_choice "none").
    tool_format: ToolFormat | None = None
    # The request's tools (OpenAI shape), which some formats read to type the arguments.
    tools: list[dict] | None = None


class ChatOutput:
    def __init__(self, config: OutputConfig | None = None):
        self.config = config or OutputConfig()
        markers = self.config.reasoning_markers
        self._reasoning = ReasoningSplitter(*markers, inside=self.config.starts_in_reasoning) if markers else None
        fmt = self.config.tool_format
        self._tools = ToolCallParser(fmt, self.config.tools) if fmt else None

    @property
    def tool_calls_seen(self) -> int:
        return self._tools.calls if self._tools else 0

    def feed(self, text: str) -> OutputDelta:
        content, reasoning = self._reasoning.feed(text) if self._reasoning else (text, "")
        return self._calls(content, reasoning, last=False)

    def finish(self) -> OutputDelta:
        content, reasoning = self._reasoning.finish() if self._reasoning else ("", "")
        return self._calls(content, reasoning, last=True)

    def _calls(self, content: str, reasoning: str, last: bool) -> OutputDelta:
        if self._tools is None:
            return OutputDelta(content, reasoning)
        content, calls = self._tools.feed(content)
        if last:
            tail, more = self._tools.finish()
            content, calls = content + tail, calls + more
        return OutputDelta(content, reasoning, calls)
