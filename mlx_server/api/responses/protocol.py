"""OpenAI Responses request schemas (responses are built as plain dicts).

Unknown fields (`include`, `truncation`, `user`, `service_tier`...) are accepted and ignored;
`null` for an optional field means its default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mlx_server.api.schema import Lenient, by_type


class InputText(Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(Lenient):
    type: Literal["refusal"]
    refusal: str


class InputImage(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(Lenient):
    type: Literal["input_file"]


ContentPart = by_type(InputText, Refusal, InputImage, InputFile)


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(Lenient):
    type: Literal["reasoning"]


class ItemReference(Lenient):
    type: Literal["item_reference"]
    id: str


InputItem = by_type(MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, ItemReference, default="message")


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(Lenient):
    format: TextFormat | None = None


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(Lenient):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None  # not OpenAI's; llama.cpp-style clients send it
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
