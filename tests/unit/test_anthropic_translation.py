"""Anthropic Messages translation without a model: requests into prompts, scripted ChatOutput
deltas (thinking, text, tool calls) into blocks and events that the official SDK accumulates."""

from __future__ import annotations

import json
import anthropic
import pytest
from mlx_lm.utils import load_tokenizer

from mlx_server.api.anthropic.protocol import MessagesRequest
from mlx_server.api.anthropic.serving import BlockStream, MessagesServing, stop_reason
from mlx_server.api.errors import APIError
from mlx_server.engine.request import GenerationEvent, Usage
from mlx_server.text.chat_output import OutputDelta, ToolCallDelta
from protocol_fakes import (
    ConnectedRequest,
    ScriptedHandle,
    ScriptedOutput,
    chat_serving,
    collect_stream,
    replaying_client,
    run_async,
    sse_frames,
)

# A ChatML template that knows tool calls and tool results, as Qwen's does.
TOOL_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# thinking, then text, then two tool calls: blocks 0..3.
SCRIPT = [
    OutputDelta(reasoning="The user wants "),
    OutputDelta(reasoning="two cities."),
    OutputDelta(content="Checking both."),
    OutputDelta(content="\n\n", tool_calls=[ToolCallDelta(0, "toolu_a", "get_weather", '{"city": ')]),
    OutputDelta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
    OutputDelta(tool_calls=[ToolCallDelta(1, "toolu_b", "get_weather", '{"city": "Rome"}')]),
]
HEAD = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m"}


def serving(tokenizer_dir, template=None) -> MessagesServing:
    tokenizer = load_tokenizer(tokenizer_dir)
    if template is not None:
        tokenizer._tokenizer.chat_template = template
    return MessagesServing(chat_serving(tokenizer))


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return serving(tiny_model_dir)


@pytest.fixture(scope="module")
def with_tools(tiny_model_dir):
    return serving(tiny_model_dir, TOOL_TEMPLATE)


def stream_bytes(script, **handle) -> bytes:
    s = MessagesServing(chat=None)
    agen = s._stream(ScriptedHandle(len(script), **handle), ScriptedOutput(script), HEAD, 20, 100, ConnectedRequest())
    return collect_stream(agen)


def test_stream_events_come_in_anthropic_order_with_block_indexes():
    frames = sse_frames(stream_bytes(SCRIPT, completion_tokens=30))
    names = [(e, d.get("index")) for e, d in frames]
    assert names == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
        ("message_delta", None), ("message_stop", None),
    ]
    assert all(d["type"] == e for e, d in frames)
    starts = [d["content_block"]["type"] for e, d in frames if e == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    deltas = [d["delta"]["type"] for e, d in frames if e == "content_block_delta"]
    assert deltas == ["thinking_delta"] * 2 + ["text_delta"] * 2 + ["input_json_delta"] * 3


def test_sdk_stream_accumulates_thinking_text_and_tool_use_blocks():
    client = anthropic.Anthropic(api_key="x", base_url="http://test", http_client=replaying_client(stream_bytes(SCRIPT)))
    with client.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "The user wants two cities."
    assert final.content[1].text == "Checking both.\n\n"
    assert [(b.id, b.name, b.input) for b in final.content[2:]] == [
        ("toolu_a", "get_weather", {"city": "Paris"}), ("toolu_b", "get_weather", {"city": "Rome"})
    ]
    assert final.stop_reason == "tool_use"
    assert final.usage.input_tokens == 20 and final.usage.output_tokens == 10


def test_non_streaming_content_equals_what_the_sdk_accumulates_from_the_stream():
    client = anthropic.Anthropic(api_key="x", base_url="http://test", http_client=replaying_client(stream_bytes(SCRIPT)))
    with client.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as stream:
        streamed = stream.get_final_message()
    s = MessagesServing(chat=None)
    response = run_async(s._complete(ScriptedHandle(len(SCRIPT)), ScriptedOutput(SCRIPT), HEAD, 100, ConnectedRequest()))
    body = json.loads(response.body)
    assert body["content"] == [{k: v for k, v in b.model_dump().items() if k in body["content"][i]}
                               for i, b in enumerate(streamed.content)]
    assert body["stop_reason"] == "tool_use"


def test_text_after_a_tool_call_opens_a_new_block():
    blocks = BlockStream()
    events = blocks.feed(OutputDelta(tool_calls=[ToolCallDelta(0, "toolu_a", "f", "{}")]))
    events += blocks.feed(OutputDelta(content="done"))
    events += blocks.close()
    assert [(e, d.get("index")) for e, d in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
    ]
    assert blocks.content == [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}, {"type": "text", "text": "done"}]


def test_blank_text_opens_no_block_but_leading_blanks_of_real_text_are_kept():
    blocks = BlockStream()
    blocks.feed(OutputDelta(reasoning="hm"))
    blocks.feed(OutputDelta(content="\n"))
    blocks.feed(OutputDelta(content=" \n"))
    blocks.feed(OutputDelta(content="Hi"))
    blocks.close()
    assert blocks.content == [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "\n \nHi"}]


def test_tool_arguments_that_are_not_json_are_kept_not_lost():
    blocks = BlockStream()
    blocks.feed(OutputDelta(tool_calls=[ToolCallDelta(0, "toolu_a", "f", "{not json")]))
    blocks.close()
    assert blocks.content[0]["input"] == {"_raw": "{not json"}


def finished(reason, completion_tokens=5, stop_sequence=None):
    return GenerationEvent(finish_reason=reason, usage=Usage(10, completion_tokens), stop_sequence=stop_sequence)


@pytest.mark.parametrize("event,used_tools,expected", [
    (finished("stop"), False, ("end_turn", None)),
    (finished("stop", stop_sequence="END"), False, ("stop_sequence", "END")),
    (finished("stop"), True, ("tool_use", None)),
    (finished("length", completion_tokens=100), False, ("max_tokens", None)),
    (finished("length", completion_tokens=100), True, ("max_tokens", None)),
    (finished("length", completion_tokens=40), False, ("model_context_window_exceeded", None)),
], ids=["eos", "stop sequence", "tool call", "max_tokens", "cut tool call", "context window"])
def test_stop_reason(event, used_tools, expected):
    assert stop_reason(event, used_tools, max_tokens=100) == expected


def tool_round_trip(**tool_result) -> MessagesRequest:
    return MessagesRequest.model_validate({
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "You are terse."}],
        "tools": [{"name": "get_weather", "description": "Weather now", "input_schema": {
            "type": "object", "properties": {"cityName": {"type": "string"}}, "required": ["cityName"]}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"cityName": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", **tool_result},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    })


def rendered(s: MessagesServing, req: MessagesRequest) -> str:
    return s.chat.prompt.tokenizer.decode(s.build_request(req, "msg_x").prompt_tokens)


def test_tool_use_and_tool_result_render_into_a_tool_template(with_tools):
    prompt = rendered(with_tools, tool_round_trip(content="sunny, 24C"))
    call = '<tool_call>{"name": "get_weather", "arguments": {"cityName": "Paris"}}</tool_call>'
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in prompt
    assert f"<|im_start|>assistant\nLet me check.{call}<|im_end|>" in prompt
    assert "<|im_start|>tool\nsunny, 24C<|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_turns_reach_a_template_without_tool_support_as_text(plain):
    prompt = rendered(plain, tool_round_trip(content=[{"type": "text", "text": "sunny"}, {"type": "text", "text": "24C"}]))
    call, result, question = prompt.index('"cityName"'), prompt.index("sunny\n24C"), prompt.index("And tomorrow?")
    assert prompt.index("Let me check.") < call < result < question


def test_tool_result_error_is_marked_as_an_error(plain):
    assert "Error: city not found" in rendered(plain, tool_round_trip(content="city not found", is_error=True))


def test_thinking_param_sets_the_templates_enable_thinking(plain):
    for kind, expected in [("enabled", True), ("adaptive", True), ("disabled", False)]:
        thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
        req = MessagesRequest.model_validate({"model": "m", "max_tokens": 2048, "thinking": thinking,
                                              "messages": [{"role": "user", "content": "hi"}]})
        _, fields = plain.translate(req)
        assert fields["chat_template_kwargs"] == {"enable_thinking": expected}


def test_tool_choice_maps_onto_the_chat_request(plain):
    def request(tool_choice):
        body = {**tool_round_trip(content="x").model_dump(by_alias=True, exclude_none=True), "tool_choice": tool_choice}
        return MessagesRequest.model_validate(body)

    def choice(tool_choice):
        return plain.translate(request(tool_choice))[1]["tool_choice"]

    assert choice({"type": "auto"}) == "auto"
    assert choice({"type": "any"}) == "required"
    assert choice({"type": "none"}) == "none"
    assert choice({"type": "tool", "name": "get_weather"}) == {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(APIError) as e:
        plain.build_request(request({"type": "tool", "name": "nope"}), "msg_x")
    assert e.value.param == "tool_choice.name" and e.value.message.startswith("tool_choice.name: ")


def test_an_error_names_the_anthropic_field_it_came_from(plain):
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "r"},
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        ]},
    ]})
    with pytest.raises(APIError) as e:
        plain.build_request(req, "msg_x")
    assert e.value.param == "messages[2].content[2]"
    assert e.value.message.startswith("messages[2].content[2]: ")
    stops = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                            "stop_sequences": [f"s{i}" for i in range(40)]})
    with pytest.raises(APIError) as e:
        plain.build_request(stops, "msg_x")
    assert e.value.param == "stop_sequences"
    assert e.value.message.startswith("stop_sequences: ")


def test_a_generation_error_mid_stream_is_an_error_event_the_sdk_raises():
    body = stream_bytes([OutputDelta(content="a")], finish_reason="error")
    name, data = sse_frames(body)[-1]
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "overloaded_error", "message": "boom"}}
    client = anthropic.Anthropic(api_key="x", base_url="http://test", http_client=replaying_client(body))
    with pytest.raises(anthropic.APIStatusError, match="boom"):
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()


def messages_request(messages: list[dict], **body) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 20, "messages": messages, **body})


ASK = {"role": "user", "content": "Capital of France?"}


@pytest.mark.parametrize("prefill", ["The capital is", [{"type": "text", "text": "The capital"}, {"type": "text", "text": " is"}]])
def test_a_final_assistant_message_is_continued(plain, prefill):
    req = messages_request([ASK, {"role": "assistant", "content": prefill}])
    assert rendered(plain, req).endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nThe capital is")
    assert plain.build_request(req, "msg_x").continues_text
    assert plain.count_tokens(req)["input_tokens"] == len(plain.build_request(req, "msg_x").prompt_tokens)


def test_an_empty_final_assistant_message_is_an_ordinary_answer(plain):
    expected = rendered(plain, messages_request([ASK]))
    for empty in ("", []):
        req = messages_request([ASK, {"role": "assistant", "content": empty}])
        assert rendered(plain, req) == expected
        assert not plain.build_request(req, "msg_x").continues_text


@pytest.mark.parametrize("prefill", ["The capital is ", "Line\n", "   ", [{"type": "text", "text": "a\t"}]])
def test_a_prefill_ending_in_whitespace_is_rejected_as_anthropic_does(plain, prefill):
    with pytest.raises(APIError) as e:
        plain.build_request(messages_request([ASK, {"role": "assistant", "content": prefill}]), "msg_x")
    assert e.value.status == 400
    assert e.value.message == "messages: final assistant content cannot end with trailing whitespace"
    assert e.value.param == "messages[1].content"


def test_a_final_assistant_tool_use_cannot_be_continued(plain):
    final = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    with pytest.raises(APIError) as e:
        plain.build_request(messages_request([ASK, final]), "msg_x")
    assert e.value.status == 400 and e.value.param == "messages[1]"


def test_thinking_budget_goes_to_the_engine_with_the_models_markers(qwen3_tokenizer_dir, plain):
    qwen3 = serving(qwen3_tokenizer_dir)
    thinking = {"type": "enabled", "budget_tokens": 7}
    budget = qwen3.build_request(messages_request([ASK], thinking=thinking), "msg_x").sampling.thinking_budget
    assert (budget.tokens, budget.start, budget.end, budget.starts_inside) == (7, [151667], [151668], False)
    opened = messages_request([ASK, {"role": "assistant", "content": "<think>\nHmm"}], thinking=thinking)
    assert qwen3.build_request(opened, "msg_x").sampling.thinking_budget.starts_inside
    for other in ({"type": "adaptive"}, {"type": "disabled"}, None):
        assert qwen3.build_request(messages_request([ASK], thinking=other), "msg_x").sampling.thinking_budget is None
    # SmolLM2 has no reasoning markers: the budget has nothing to limit.
    assert plain.build_request(messages_request([ASK], thinking=thinking), "msg_x").sampling.thinking_budget is None


@pytest.mark.parametrize("budget, ok", [(19, True), (20, False), (21, False)])
def test_budget_tokens_must_be_below_max_tokens(budget, ok):
    body = {"model": "m", "max_tokens": 20, "messages": [ASK], "thinking": {"type": "enabled", "budget_tokens": budget}}
    if ok:
        MessagesRequest.model_validate(body)
    else:
        with pytest.raises(ValueError, match="`max_tokens` must be greater than `thinking.budget_tokens`"):
            MessagesRequest.model_validate(body)
