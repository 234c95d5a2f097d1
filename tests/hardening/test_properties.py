"""Property tests of every parser of untrusted input: whatever a client sends, the answer is a
result or a 400 naming the field, never an exception that would become a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from httpx._decoders import LineDecoder
from pydantic import ValidationError

from mlx_server.api.app import Guard
from mlx_server.api.errors import APIError, _field_path, openai_error_body, validation_error
from mlx_server.api.limits import MAX_JSON_DEPTH, check_depth, check_template_kwargs, has_lone_surrogate
from mlx_server.api.openai.protocol import ChatCompletionRequest
from mlx_server.api.sse import data_frame, event_frame
from mlx_server.cli import _size
from mlx_server.config import Settings
from mlx_server.media import MediaError, MediaPolicy, load_image, read_media

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text a valid UTF-8 request can carry (the Guard refuses lone surrogates before parsing).
text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=20)

ROLES = ["system", "developer", "user", "assistant", "tool", "function"]
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.dictionaries(text, scalars, max_size=2)}),
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text, "arguments": text | st.dictionaries(text, scalars, max_size=3)})},
        optional={"id": text},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(ROLES)},
        optional={
            "content": st.none() | text | st.lists(parts, max_size=4),
            "name": text,
            "tool_call_id": text,
            "tool_calls": tool_calls,
            "reasoning_content": text,
        },
    ),
    min_size=1,
    max_size=6,
)
chat_bodies = st.fixed_dictionaries({"model": text, "messages": messages}, optional={
    "temperature": scalars, "max_tokens": scalars, "stop": scalars | st.lists(text, max_size=3), "stream": scalars,
    "logit_bias": st.dictionaries(text, scalars, max_size=3), "chat_template_kwargs": st.dictionaries(text, json_values, max_size=3),
})


@pytest.fixture(scope="module")
def chat(idle_engine):
    """ChatServing with the tiny model's real tokenizer and chat template (no engine thread)."""
    from mlx_server.api.openai.serving import ChatServing

    return ChatServing(idle_engine, Settings(model_id="tiny", ctx_size=1 << 20))


def assert_is_a_400(err: APIError) -> None:
    assert err.status == 400
    assert err.message
    assert err.param is None or isinstance(err.param, str)
    json.dumps(openai_error_body(err)).encode()


@PROPERTY
@given(body=json_values | chat_bodies)
def test_any_json_body_validates_or_becomes_one_400_naming_fields(body):
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        assert_is_a_400(validation_error(e.errors()))


@PROPERTY
@given(loc=st.lists(st.one_of(text, st.integers()), max_size=8))
def test_any_error_location_becomes_a_field_path(loc):
    assert isinstance(_field_path(tuple(loc)), str)


@PROPERTY
@given(body=chat_bodies)
def test_every_valid_request_renders_to_tokens_or_is_a_400(chat, body):
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    try:
        if req.chat_template_kwargs:
            check_template_kwargs(req.chat_template_kwargs)
        rendered = [chat.template_message(i, m) for i, m in enumerate(req.messages)]
        for m in rendered:
            assert m["role"] in {"system", "user", "assistant", "tool"}
            assert isinstance(m["content"], str)
        prompt = chat.prompt.render(rendered, None, req.chat_template_kwargs)
    except APIError as e:
        assert_is_a_400(e)
        return
    assert isinstance(prompt, str)
    assert all(isinstance(t, int) for t in chat.prompt.encode(prompt))


@PROPERTY
@given(obj=json_values)
def test_a_data_frame_is_one_sse_event_whatever_the_text(obj):
    frame = data_frame({"x": obj})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2 and b"\r" not in frame
    lines = LineDecoder().decode(frame.decode()) + LineDecoder().flush()
    assert lines[1:] == [""]  # httpx splits like str.splitlines: on U+2028, U+0085... too
    assert json.loads(lines[0][len("data: "):]) == {"x": obj}


@PROPERTY
@given(obj=json_values)
def test_an_event_frame_is_one_sse_event_whatever_the_text(obj):
    frame = event_frame("content_block_delta", {"x": obj})
    assert frame.count(b"\n") == 3 and frame.endswith(b"\n\n") and b"\r" not in frame
    event, data, blank = frame.decode().splitlines()
    assert event == "event: content_block_delta" and blank == ""
    assert json.loads(data[len("data: "):]) == {"x": obj}


@PROPERTY
@given(arg=st.text(max_size=12) | st.from_regex(r"\A-?[0-9]{0,20}(\.[0-9]*)?([eE][0-9]{1,4})?[kKmMgGtT]?[iI]?[bB]?\Z"))
def test_size_option_is_bytes_or_a_clean_usage_error(arg):
    try:
        value = _size(arg)
    except argparse.ArgumentTypeError as e:
        assert str(e)
        return
    assert isinstance(value, int) and value >= 0


@PROPERTY
@given(n=st.integers(0, 10**6), unit=st.sampled_from(["", "k", "K", "m", "M", "g", "G", "KiB", "MB", "gib"]))
def test_size_option_reads_its_units(n, unit):
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit[:1].lower()]
    assert _size(f"{n}{unit}") == n * scale


KEY = b"s3cret-key"
header_values = st.binary(max_size=24) | st.sampled_from([b"Bearer " + KEY, b"bearer " + KEY + b"  ", b"Bearer  " + KEY, KEY, b"BEARER " + KEY, b"Bearer " + KEY[:-1]])


@PROPERTY
@given(
    authorization=st.none() | header_values,
    x_api_key=st.none() | header_values,
    content_length=st.none() | st.binary(max_size=8) | st.sampled_from([b"0", b"99999999999999999999", b"-1", b"+5"]),
    method=st.sampled_from(["GET", "POST", "OPTIONS"]),
    path=st.sampled_from(["/health", "/v1/chat/completions", "/metrics", "/x"]),
)
def test_guard_admits_exactly_the_right_key_and_never_raises(authorization, x_api_key, content_length, method, path):
    headers = [(name, value) for name, value in (
        (b"authorization", authorization), (b"x-api-key", x_api_key), (b"content-length", content_length)) if value is not None]
    reached, statuses = [], []

    async def inner(scope, receive, send):
        reached.append(True)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    guard = Guard(inner, Settings(model_id="m", api_key=KEY.decode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(guard(scope, receive, send))

    bearer = authorization or b""
    token = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else None
    authorized = path == "/health" or token == KEY or x_api_key == KEY
    too_large = bool(content_length) and content_length.isdigit() and int(content_length) > 10 * 1024 * 1024
    assert reached == ([True] if authorized and not too_large else [])
    assert statuses == ([] if reached else [401 if not authorized else 413])


@PROPERTY
@given(s=st.text(max_size=12))
def test_lone_surrogates_are_found_in_any_json_text(s):
    try:
        s.encode("utf-8")
        valid = True
    except UnicodeEncodeError:
        valid = False
    assert has_lone_surrogate(json.dumps({"k": s}).encode()) == (not valid)
    assert has_lone_surrogate(json.dumps({"k": s}, ensure_ascii=False).encode("utf-8", "surrogatepass")) == (not valid)


@PROPERTY
@given(depth=st.integers(1, 3 * MAX_JSON_DEPTH), as_list=st.booleans())
def test_json_nested_deeper_than_the_limit_is_a_400(depth, as_list):
    value: object = 1
    for _ in range(depth - 1):
        value = [value] if as_list else {"k": value}
    if depth <= MAX_JSON_DEPTH:
        check_depth(value, "tools")
    else:
        with pytest.raises(APIError) as e:
            check_depth(value, "tools")
        assert_is_a_400(e.value)


NO_REMOTE = MediaPolicy(allow_remote=False, max_bytes=1 << 16)
url_prefixes = st.sampled_from(["", "/", "file://", "file:///", "FILE://localhost/", "file://[", "data:", "data:image/png;base64,",
                                "data:;base64,", "http://", "https://[", "ftp://", "~/", "C:\\"])


@PROPERTY
@given(url=st.builds(lambda prefix, rest: prefix + rest, url_prefixes, st.text(max_size=30)))
def test_any_image_url_is_read_or_refused_with_a_media_error(url):
    try:
        assert isinstance(read_media(url, NO_REMOTE), bytes)
    except MediaError as e:
        assert str(e)


@PROPERTY
@given(payload=st.binary(max_size=256))
def test_any_data_url_payload_decodes_or_is_refused_with_a_media_error(payload):
    try:
        load_image("data:image/png;base64," + base64.b64encode(payload).decode(), NO_REMOTE)
    except MediaError as e:
        assert str(e)
