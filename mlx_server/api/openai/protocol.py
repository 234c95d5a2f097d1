"""OpenAI Chat Completions request schema (responses are built as plain dicts on the hot path).

`null` for any optional field means its default (OpenAI marks them nullable); unknown fields
are accepted and ignored; types are strict, so `"stream": "yes"` is a 400, not a guess.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class ImageURLPart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Lenient):
    url: str


class VideoURLPart(_Lenient):
    type: Literal["video_url"]
    video_url: VideoURL


class InputAudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: dict


class FilePart(_Lenient):
    type: Literal["file"]
    file: dict


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    Union[TextPart, ImageURLPart, VideoURLPart, InputAudioPart, FilePart, RefusalPart],
    Field(discriminator="type"),
]


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Jan's extension: media as URL arrays beside the content.
    images: list[str] | None = None
    videos: list[str] | None = None


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class GenerationFields(_Lenient):
    """What chat and legacy completions share: streaming, length, sampling and stop strings."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n_predict: int | None = Field(None, ge=-1)  # llama.cpp's name; -1 means unlimited
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None  # 0 or less disables it, as in llama.cpp
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    repeat_penalty: float | None = Field(None, gt=0, le=10)  # llama.cpp's name, sent by Jan
    repeat_last_n: int | None = Field(None, ge=-1)  # the penalty window; -1 = whole context
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(GenerationFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict | None = None
    # Tools stay plain JSON here (checked in serving.py), as the chat template receives them.
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    # vLLM's: continue the last (assistant) message instead of starting a new one (a prefill).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
