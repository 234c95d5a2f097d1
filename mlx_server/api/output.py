"""What one request's output must look like, and how to read it: shared by every protocol.

A protocol says what its client asked for (tools, tool choice, a JSON schema) as an
OutputRequest; `OutputPlanner.plan` answers, from the request's rendered prompt, with the
OutputConfig that ChatOutput reads the text with and the grammar the engine decodes under.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import llguidance

from mlx_server.api.errors import APIError
from mlx_server.config import Settings
from mlx_server.engine import guidance
from mlx_server.engine.request import ThinkingBudget
from mlx_server.log import logger
from mlx_server.text.chat_output import OutputConfig
from mlx_server.text.grammar import JSON_STYLE, OutputShape, can_constrain_tools, closed, output_grammar
from mlx_server.text.tool_calls import ToolFormat, infer_tool_format, tool_format


@dataclass
class OutputRequest:
    """What the client asked of the output, in OpenAI's terms."""

    tools: list[dict] | None = None  # [{"type": "function", "function": {"name", "parameters"...}}]
    tool_choice: str = "auto"  # "auto", "none", "required", or "function" (then tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    json_schema: dict | None = None  # the answer must be one JSON value of this schema
    tools_param: str = "tools"  # the field that errors about the tools name
    schema_param: str = "response_format"
    prefill: str = ""  # the assistant's text the output continues (the prompt ends with it)


@dataclass
class OutputPlan:
    config: OutputConfig
    grammar: str | None = None  # for GenerationRequest.grammar
    banned_tokens: list[int] = field(default_factory=list)  # never to be sampled (tool_choice "none")


class OutputPlanner:
    """Per model: its reasoning markers and tool-call format; per request: the plan."""

    def __init__(self, tokenizer, settings: Settings, template_source: str):
        self.tokenizer = tokenizer
        self.think = reasoning_markers(tokenizer, template_source)
        self.split_reasoning = settings.reasoning_format != "none"
        # A model with no tool format of its own (SmolLM2) still gets `required` and named calls,
        # written the most common way (Hermes / Qwen JSON in <tool_call>).
        name = settings.tool_call_parser or infer_tool_format(tokenizer, template_source) or "json_tools"
        self.tool_format: ToolFormat = tool_format(name)
        self._warned: set[str] = set()
        # llguidance's tokenizer takes seconds to build for a large vocabulary: not on the first request.
        threading.Thread(target=guidance.ll_tokenizer, args=(tokenizer,), name="llguidance-tokenizer", daemon=True).start()

    def plan(self, prompt_text: str, want: OutputRequest) -> OutputPlan:
        """Raises a 400 APIError when a schema uses something constrained decoding cannot enforce."""
        inside = self.starts_in_reasoning(prompt_text, want.prefill)
        config = OutputConfig(starts_in_reasoning=inside, reasoning_markers=self.think if self.split_reasoning else None)
        fmt = self.tool_format
        tools = want.tools or []
        banned: list[int] = []
        if tools and want.tool_choice == "none":
            # The tools stay in the prompt (the conversation may mention them), but no call can start.
            if (token := guidance.special_token(self.tokenizer, fmt.start)) is not None:
                banned.append(token)
            tools = []
        if want.tool_choice == "function":
            tools = [t for t in tools if t["function"]["name"] == want.tool_name]
        if tools:
            config.tool_format, config.tools = fmt, want.tools
        constrain_tools = bool(tools) and can_constrain_tools(fmt.name)
        if tools and not constrain_tools and want.tool_choice in ("required", "function"):
            self._warn_once(f"tool_choice '{want.tool_choice}' is not enforced: no grammar for tool-call format {fmt.name!r}")
        if want.json_schema is not None:
            self._check_schema(want.json_schema, want.schema_param)
        if constrain_tools:
            for i, tool in enumerate(want.tools):
                if tool in tools:
                    params = tool["function"].get("parameters") or {"type": "object"}
                    self._check_schema(closed(params), f"{want.tools_param}[{i}].function.parameters")
        shape = OutputShape(
            reasoning_markers=self.think,
            starts_in_reasoning=inside,
            tool_format=(fmt.name, fmt.start, fmt.end) if constrain_tools else None,
            tools=tools if constrain_tools else None,
            tools_required=want.tool_choice in ("required", "function"),
            parallel_tool_calls=want.parallel_tool_calls,
            json_schema=want.json_schema,
        )
        grammar = output_grammar(shape, lambda text: guidance.special_token(self.tokenizer, text))
        if grammar is not None and (error := guidance.grammar_error(self.tokenizer, grammar)):
            raise APIError(400, f"constrained decoding cannot enforce this request: {error}", param=want.tools_param)
        return OutputPlan(config, grammar, banned)

    def starts_in_reasoning(self, prompt_text: str, prefill: str = "") -> bool:
        """Whether the output starts inside a reasoning block: the prompt ends with the start marker
        (a template that opens it), or a prefill the output continues left one open."""
        if not self.think:
            return False
        start, end = self.think
        opened, closed = prefill.rfind(start), prefill.rfind(end)
        if opened != closed:  # only equal (-1) when the prefill has neither marker
            return opened > closed
        head = prompt_text[: len(prompt_text) - len(prefill)] if prefill and prompt_text.endswith(prefill) else prompt_text
        return head.rstrip().endswith(start)

    def thinking_budget(self, tokens: int, starts_inside: bool) -> ThinkingBudget | None:
        """The engine's budget for `tokens` tokens of reasoning; None for a model without reasoning markers."""
        if not self.think:
            return None
        start, end = (self.tokenizer.encode(marker, add_special_tokens=False) for marker in self.think)
        return ThinkingBudget(tokens, start, end, starts_inside)

    def _check_schema(self, schema: dict, param: str) -> None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        if error := guidance.grammar_error(self.tokenizer, grammar):
            raise APIError(400, f"{param}: this JSON schema cannot be enforced: {error}", param=param)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)


def reasoning_markers(tokenizer, template_source: str) -> tuple[str, str] | None:
    """The model's reasoning markers: mlx-lm's from the vocabulary, else `<think>` if the template writes it."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if start and end:
        return start, end
    if "<think>" in template_source and "</think>" in template_source:
        return "<think>", "</think>"
    return None
