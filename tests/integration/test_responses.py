"""OpenAI Responses through the official `openai` SDK and raw HTTP, validated against OpenAI's schemas."""

from __future__ import annotations

import openai
import pytest

from openai_schema import assert_valid
from protocol_fakes import RESPONSE_EVENT_SCHEMAS, sse_frames

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_create_returns_a_response_matching_openai_schema(client):
    r = client.post("/v1/responses", json={"model": "m", "input": "Say hello.", "max_output_tokens": 6, "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_valid("Response", body)
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == "m"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["usage"]["output_tokens"] == 6
    assert body["instructions"] == "Be brief."


def test_sdk_create_streaming_and_not_give_the_same_text(sdk):
    whole = sdk.responses.create(model="tiny", input="Say hello.", max_output_tokens=12, **GREEDY)
    events = list(sdk.responses.create(model="tiny", input="Say hello.", max_output_tokens=12, stream=True, **GREEDY))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    assert whole.output_text


def test_raw_stream_events_match_their_schemas_in_order(client):
    r = client.post("/v1/responses", json={"model": "m", "input": "Say hello.", "max_output_tokens": 4, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.content)
    for name, data in frames:
        assert name == data["type"]
        assert_valid(RESPONSE_EVENT_SCHEMAS[name], data)
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    names = [name.removeprefix("response.") for name, _ in frames]
    assert names[:4] == ["created", "in_progress", "output_item.added", "content_part.added"]
    assert names[-4:] == ["output_text.done", "content_part.done", "output_item.done", "incomplete"]


def test_two_turn_conversation_through_previous_response_id(sdk, client):
    first = sdk.responses.create(model="tiny", input="Say hello.", instructions="Be brief.", max_output_tokens=5, **GREEDY)
    second = sdk.responses.create(model="tiny", input="Again, please.", previous_response_id=first.id,
                                  max_output_tokens=5, **GREEDY)
    assert second.previous_response_id == first.id
    # The second prompt is the first turn, its answer and the new input; instructions are not carried over.
    conversation = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Again, please."}]
    expected = client.post("/tokenize", json={"messages": conversation}).json()["count"]
    assert second.usage.input_tokens == expected


def test_function_call_output_round_trip(sdk):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather now",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}]
    response = sdk.responses.create(model="tiny", tools=tools, max_output_tokens=6, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], **GREEDY)
    assert response.output[0].type == "message"
    assert response.tools[0].name == "get_weather"


def test_stored_responses_can_be_retrieved_and_deleted(sdk):
    response = sdk.responses.create(model="tiny", input="Hi.", max_output_tokens=2)
    assert sdk.responses.retrieve(response.id).output_text == response.output_text
    sdk.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)


def test_store_false_keeps_nothing(sdk):
    response = sdk.responses.create(model="tiny", input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model="tiny", input="More.", previous_response_id=response.id, max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found"
