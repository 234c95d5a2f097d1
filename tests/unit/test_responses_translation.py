"""OpenAI Responses translation without a model: input items and stored conversations into
prompts, scripted ChatOutput deltas (reasoning, text, function calls) into output items and
`response.*` events that match OpenAI's schemas and that the official SDK parses."""

from __future__ import annotations

import json
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from mlx_server.api.errors import APIError
from mlx_server.api.responses.protocol import ResponsesRequest
from mlx_server.api.responses.serving import ResponsesServing, response_head
from mlx_server.api.responses.store import ResponseStore, StoredResponse
from mlx_server.engine.request import SamplingParams
from mlx_server.text.chat_output import OutputDelta, ToolCallDelta
from openai_schema import assert_valid
from protocol_fakes import (
    RESPONSE_EVENT_SCHEMAS,
    ConnectedRequest,
    ScriptedHandle,
    ScriptedOutput,
    chat_serving,
    collect_stream,
    replaying_client,
    run_async,
    sse_frames,
)
from unit.test_anthropic_translation import TOOL_TEMPLATE

SCRIPT = [
    OutputDelta(reasoning="Two cities, "),
    OutputDelta(reasoning="two calls."),
    OutputDelta(content="Checking."),
    OutputDelta(tool_calls=[ToolCallDelta(0, "call_a", "get_weather", '{"city": ')]),
    OutputDelta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
    OutputDelta(tool_calls=[ToolCallDelta(1, "call_b", "get_weather", '{"city": "Rome"}')]),
]
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def serving(tokenizer):
    return ResponsesServing(chat_serving(tokenizer), ResponseStore(4))


@pytest.fixture(scope="module")
def with_tools(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer._tokenizer.chat_template = TOOL_TEMPLATE
    return ResponsesServing(chat_serving(tokenizer))


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": TOOLS, **fields})


def stream_bytes(serving, script=SCRIPT, **handle) -> bytes:
    head = response_head("resp_1", request(), SamplingParams())
    agen = serving._stream(ScriptedHandle(len(script), **handle), ScriptedOutput(script), head, (), True, ConnectedRequest())
    return collect_stream(agen)


def complete(serving, script=SCRIPT, **handle) -> dict:
    head = response_head("resp_1", request(), SamplingParams())
    response = run_async(serving._complete(ScriptedHandle(len(script), **handle), ScriptedOutput(script), head, (), True,
                                           ConnectedRequest()))
    return json.loads(response.body)


def test_stream_events_come_in_documented_order_and_match_openai_schemas(serving):
    frames = sse_frames(stream_bytes(serving))
    for name, data in frames:
        assert name == data["type"]
        assert_valid(RESPONSE_EVENT_SCHEMAS[name], data)
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    assert [(n.removeprefix("response."), d.get("output_index")) for n, d in frames] == [
        ("created", None), ("in_progress", None),
        ("output_item.added", 0), ("content_part.added", 0), ("reasoning_text.delta", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.done", 0), ("content_part.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1),
        ("output_text.done", 1), ("content_part.done", 1), ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2), ("output_item.done", 2),
        ("output_item.added", 3), ("function_call_arguments.delta", 3), ("function_call_arguments.done", 3),
        ("output_item.done", 3),
        ("completed", None),
    ]


def test_sdk_stream_helper_accumulates_reasoning_message_and_function_calls(serving):
    client = openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=replaying_client(stream_bytes(serving)))
    with client.responses.stream(model="m", input="hi") as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Two cities, two calls."
    assert final.output_text == "Checking."
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in final.output[2:]] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_weather", {"city": "Rome"})
    ]
    assert final.status == "completed"


def test_non_streaming_response_matches_the_schema_and_the_streamed_output(serving):
    body = complete(serving)
    assert_valid("Response", body)
    streamed = sse_frames(stream_bytes(serving))[-1][1]["response"]

    def without_ids(output):
        return [{k: v for k, v in item.items() if k != "id"} for item in output]

    assert without_ids(body["output"]) == without_ids(streamed["output"])
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_max_output_tokens_makes_the_response_incomplete(serving):
    script = [OutputDelta(content="partial")]
    frames = sse_frames(stream_bytes(serving, script, finish_reason="length"))
    last = frames[-1][1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    body = complete(serving, script, finish_reason="length")
    assert_valid("Response", body)
    assert body["status"] == "incomplete"


def test_a_generation_error_is_response_failed(serving):
    frames = sse_frames(stream_bytes(serving, [OutputDelta(content="a")], finish_reason="error"))
    name, data = frames[-1]
    assert name == "response.failed"
    assert_valid("ResponseFailedEvent", data)
    assert data["response"]["error"]["code"] == "server_error"


def test_the_stored_conversation_ends_with_the_answer_as_an_assistant_turn(serving):
    complete(serving)
    stored = serving.store.get("resp_1")
    assert stored.response["id"] == "resp_1"
    answer = stored.history[-1]
    assert answer["role"] == "assistant" and answer["content"] == "Checking."
    assert answer["reasoning_content"] == "Two cities, two calls."
    assert [c["id"] for c in answer["tool_calls"]] == ["call_a", "call_b"]


def rendered(serving, req: ResponsesRequest) -> str:
    from mlx_server.api.chat_like import build_request
    from mlx_server.api.responses.serving import RENAMES

    translation, fields = serving.translate(req)
    gen = build_request(serving.chat, translation, RENAMES, "resp_x", **fields)
    return serving.chat.prompt.tokenizer.decode(gen.prompt_tokens)


def test_function_calls_and_their_outputs_render_into_the_prompt(with_tools):
    prompt = rendered(with_tools, request(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert f"<|im_start|>assistant\nChecking.{call}<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>" in prompt


def test_previous_response_id_continues_the_stored_conversation_with_new_instructions(serving):
    history = ({"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"})
    serving.store.put("resp_0", StoredResponse({"id": "resp_0"}, history))
    prompt = rendered(serving, request(input="second question", previous_response_id="resp_0", instructions="Be brief."))
    assert prompt.index("Be brief.") < prompt.index("first question") < prompt.index("first answer") < prompt.index("second question")


def test_unknown_previous_response_id_is_a_400_naming_it(serving):
    with pytest.raises(APIError) as e:
        serving.translate(request(previous_response_id="resp_gone"))
    assert (e.value.status, e.value.param, e.value.code) == (400, "previous_response_id", "previous_response_not_found")


def test_an_error_names_the_input_item_it_came_from(serving):
    req = request(input=[{"role": "user", "content": "a"},
                         {"role": "user", "content": [{"type": "input_text", "text": "b"},
                                                      {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    with pytest.raises(APIError) as e:
        rendered(serving, req)
    assert e.value.param == "input[1].content[1]"


def test_store_forgets_the_least_recently_used_beyond_its_capacity():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, ()))
    store.get("a")
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2
