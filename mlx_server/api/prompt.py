"""Shared by every protocol: chat-template messages -> prompt tokens within the context window.

Each protocol translates its own messages into the shape chat templates expect
(`{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}`) and hands them here.
"""

from __future__ import annotations

import jinja2

from mlx_server.api.errors import APIError
from mlx_server.api.sse import dumps
from mlx_server.config import Settings


class ChatPrompt:
    def __init__(self, tokenizer, settings: Settings):
        self.tokenizer = tokenizer
        self.settings = settings
        self.template_source = settings.chat_template or tokenizer.chat_template or ""
        self.vocab_size = max(tokenizer.vocab_size, len(tokenizer.get_vocab()))

    @property
    def template_supports_tools(self) -> bool:
        return "tool_calls" in self.template_source

    def assistant_tool_calls(self, message: dict, calls: list[dict]) -> dict:
        """Attach tool calls to an assistant message; a template without tool support sees them as text."""
        if self.template_supports_tools:
            return {**message, "tool_calls": calls}
        content = message.get("content") or ""
        text = dumps([c["function"] for c in calls])
        return {**message, "content": (content + "\n" if content else "") + text}

    def render(self, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None,
               continue_final: bool = False, generation_prompt: bool = True) -> str:
        """The prompt text, ending where the assistant's answer starts; template errors are 400s.

        `continue_final`: the last message is an assistant's text to continue (a prefill), so the prompt
        ends inside it (transformers' `continue_final_message`: the template renders the message,
        which is cut after its text). `generation_prompt` False: no assistant header after the last turn.
        """
        if not self.template_source and not self.tokenizer.has_chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            if continue_final:
                return text[: -len("\n")]
            return text + ("assistant: " if generation_prompt else "")
        kwargs = dict(template_kwargs or {})
        if self.settings.chat_template:  # --chat-template
            kwargs["chat_template"] = self.settings.chat_template
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt and not continue_final,
                continue_final_message=continue_final, tokenize=False, **kwargs
            )
        except jinja2.TemplateError as e:
            raise APIError(400, f"the model's chat template rejected these messages: {e}", param="messages")
        except ValueError as e:
            if continue_final and "continue_final_message" in str(e):
                raise APIError(400, "the model's chat template does not render the final assistant message as it was "
                                    "sent, so it cannot be continued", param="messages")
            raise APIError(400, f"could not render the chat template for these messages: {e}", param="messages")
        except Exception as e:  # the template is fixed, so only the messages can have made it fail
            raise APIError(400, f"could not render the chat template for these messages: {e}", param="messages")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_budget(self, n_prompt: int, requested: int | None, param: str = "messages") -> int:
        """max_tokens bounded by the context window; a prompt that cannot fit is a 400."""
        ctx = self.settings.ctx_size
        room = ctx - n_prompt
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens, but the prompt is "
                f"{n_prompt} tokens. Shorten the messages or start the server with a larger --ctx-size.",
                param=param,
                code="context_length_exceeded",
            )
        return min(requested, room) if requested else room

    def stop_strings(self, stop: str | list[str] | None, param: str = "stop") -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        limit, length = self.settings.max_stop_strings, self.settings.max_stop_length
        if len(stops) > limit:
            raise APIError(400, f"{param}: at most {limit} stop strings are allowed, got {len(stops)}", param=param)
        if any(len(s) > length for s in stops):
            raise APIError(400, f"{param}: each stop string must be at most {length} characters", param=param)
        return [s for s in stops if s]
