"""A chat request's rendered prompt and output plan, with the real Qwen3 tokenizer and template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlx_server.api.errors import APIError
from mlx_server.api.openai.protocol import ChatCompletionRequest
from mlx_server.api.openai.serving import ChatServing
from mlx_server.config import Settings

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def serving(tokenizer, **settings) -> ChatServing:
    return ChatServing(SimpleNamespace(tokenizer=tokenizer, vision=None), Settings(model_id="m", **settings))


def build(chat: ChatServing, **body):
    return chat.build_request(ChatCompletionRequest.model_validate({"model": "m", **body}), "chatcmpl-test")


def prompt_text(chat: ChatServing, **body) -> str:
    return chat.prompt.tokenizer.decode(build(chat, **body).prompt_tokens)


@pytest.fixture(scope="module")
def chat(qwen3_tokenizer):
    return serving(qwen3_tokenizer)


def test_assistant_tool_call_and_tool_result_are_both_rendered(chat):
    text = prompt_text(chat, tools=TOOLS, messages=[
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    result = "<tool_response>\n{\"temp\": 21}\n</tool_response>"
    assert call in text and result in text
    assert text.index(call) < text.index(result)
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_are_rendered_into_the_prompt(chat):
    text = prompt_text(chat, tools=TOOLS, messages=[ASK])
    assert "# Tools" in text and '"name": "get_weather"' in text


def test_earlier_reasoning_content_reaches_the_template(chat):
    text = prompt_text(chat, tools=TOOLS, messages=[
        ASK,
        {"role": "assistant", "content": None, "reasoning_content": "I should look it up.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert "<think>\nI should look it up.\n</think>" in text


def test_reasoning_effort_is_passed_to_the_template(qwen3_tokenizer):
    chat = serving(qwen3_tokenizer, chat_template="{{ messages[0].content }}|{{ reasoning_effort }}")
    assert prompt_text(chat, messages=[ASK], reasoning_effort="high") == "Weather in Paris?|high"


def test_output_starts_in_reasoning_only_when_the_rendered_prompt_opens_think(qwen3_tokenizer, chat):
    assert build(chat, messages=[ASK]).output.starts_in_reasoning is False
    opened = serving(qwen3_tokenizer, chat_template="{{ messages[0].content }}<think>\n")
    assert build(opened, messages=[ASK]).output.starts_in_reasoning is True
    # A template that writes <think> in a branch this prompt does not take.
    closed = serving(qwen3_tokenizer, chat_template="{% if false %}<think>{% endif %}{{ messages[0].content }}")
    assert build(closed, messages=[ASK]).output.starts_in_reasoning is False


def test_reasoning_format_none_leaves_reasoning_inline_but_lets_the_model_think(qwen3_tokenizer):
    chat = serving(qwen3_tokenizer, reasoning_format="none")
    request = build(chat, messages=[ASK], response_format={"type": "json_object"})
    assert request.output.reasoning_markers is None
    assert "<[151667]>" in request.grammar  # <think>: the grammar still allows a reasoning block


def test_tools_are_parsed_in_the_models_format(chat):
    request = build(chat, messages=[ASK], tools=TOOLS)
    assert request.output.tool_format.name == "json_tools"
    assert request.output.reasoning_markers == ("<think>", "</think>")


def test_tool_choice_none_bans_the_call_token_and_parses_no_calls(chat):
    request = build(chat, messages=[ASK], tools=TOOLS, tool_choice="none")
    assert request.sampling.logit_bias == {151657: float("-inf")}  # <tool_call>
    assert request.output.tool_format is None and request.grammar is None


def test_tool_call_parser_option_overrides_the_inferred_format(qwen3_tokenizer):
    chat = serving(qwen3_tokenizer, tool_call_parser="qwen3_coder")
    request = build(chat, messages=[ASK], tools=TOOLS, tool_choice="required")
    assert request.output.tool_format.name == "qwen3_coder"
    assert "<function=get_weather>" in request.grammar


def test_logprobs_ask_the_engine_for_top_alternatives(chat):
    assert build(chat, messages=[ASK]).logprobs is None
    assert build(chat, messages=[ASK], logprobs=True).logprobs == 0
    assert build(chat, messages=[ASK], logprobs=True, top_logprobs=5).logprobs == 5


def test_unsupported_response_format_schema_is_a_400_that_says_which_keyword(chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}
    with pytest.raises(APIError) as e:
        build(chat, messages=[ASK], response_format=fmt)
    assert e.value.status == 400
    assert e.value.param == "response_format.json_schema.schema"
    assert "not" in e.value.message


def test_json_object_response_format_constrains_to_an_object(chat):
    request = build(chat, messages=[ASK], response_format={"type": "json_object"})
    assert '%json {"type": "object"' in request.grammar
    assert json.loads(request.grammar.split("%json ", 1)[1].split("\n")[0])["type"] == "object"


PREFILLED = [ASK, {"role": "assistant", "content": "The weather in Paris is"}]


def test_continue_final_message_ends_the_prompt_inside_the_assistant_message(chat):
    request = build(chat, messages=PREFILLED, continue_final_message=True, add_generation_prompt=False)
    text = chat.prompt.tokenizer.decode(request.prompt_tokens)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe weather in Paris is")
    assert request.continues_text and not request.output.starts_in_reasoning
    assert build(chat, messages=PREFILLED, continue_final_message=True).prompt_tokens == request.prompt_tokens
    assert not build(chat, messages=PREFILLED).continues_text
    assert prompt_text(chat, messages=PREFILLED).endswith("The weather in Paris is<|im_end|>\n<|im_start|>assistant\n")


def test_a_prefill_that_opens_think_starts_the_output_in_reasoning(chat):
    def inside(prefill: str) -> bool:
        messages = [ASK, {"role": "assistant", "content": prefill}]
        return build(chat, messages=messages, continue_final_message=True).output.starts_in_reasoning

    assert inside("<think>\nLet me")
    assert not inside("<think>\nDone.\n</think>\n\nIt is")
    assert not inside("It is")


def test_a_template_that_opens_think_before_the_prefill_starts_it_in_reasoning(qwen3_tokenizer):
    opened = serving(qwen3_tokenizer, chat_template="{% for m in messages %}{% if m.role == 'assistant' %}<think>\n{% endif %}{{ m.content }}{% endfor %}")
    messages = [ASK, {"role": "assistant", "content": "Hmm"}]
    assert build(opened, messages=messages, continue_final_message=True).output.starts_in_reasoning
    messages[1]["content"] = "Hmm</think>It is"
    assert not build(opened, messages=messages, continue_final_message=True).output.starts_in_reasoning


@pytest.mark.parametrize("body, param", [
    ({"messages": [ASK], "continue_final_message": True}, "continue_final_message"),
    ({"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
])
def test_continue_final_message_needs_a_final_assistant_message_and_no_generation_prompt(chat, body, param):
    with pytest.raises(APIError) as e:
        build(chat, **body)
    assert e.value.status == 400 and e.value.param == param


def test_a_template_that_does_not_render_the_final_message_cannot_continue_it(qwen3_tokenizer):
    chat = serving(qwen3_tokenizer, chat_template="{{ messages[0].content }}")
    with pytest.raises(APIError) as e:
        build(chat, messages=PREFILLED, continue_final_message=True)
    assert e.value.status == 400 and "cannot be continued" in e.value.message
