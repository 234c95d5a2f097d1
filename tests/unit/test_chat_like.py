"""What the Anthropic and Responses translations share: cutting ChatOutput deltas into segments,
and naming a chat-path error's field in the caller's own protocol."""

from __future__ import annotations

import pytest

from mlx_server.api.chat_like import ChatTranslation, Segments
from mlx_server.api.errors import APIError
from mlx_server.text.chat_output import OutputDelta, ToolCallDelta


def segments(deltas: list[OutputDelta]) -> list[tuple[str, str]]:
    """(kind, whole text) of every segment, checking that starts and ends pair up."""
    s, out, open_kind = Segments(), [], None
    for step in [st for d in deltas for st in s.feed(d)] + s.close():
        if step.op == "start":
            assert open_kind is None
            open_kind = step.kind
            out.append((step.kind, step.call.name if step.call else ""))
        elif step.op == "append":
            assert step.kind == open_kind
            out[-1] = (step.kind, out[-1][1] + step.text)
        else:
            assert step.kind == open_kind
            open_kind = None
    assert open_kind is None
    return out


REASONING, ANSWER = "Let me think.\n", "\n\nThe answer is 4.\n"


@pytest.mark.parametrize("cut", range(len(REASONING) + len(ANSWER) + 1))
def test_segments_do_not_depend_on_where_the_text_was_cut(cut):
    text = REASONING + ANSWER
    deltas = []
    for a, b in [(0, cut), (cut, len(text))]:
        r = text[max(a, 0):min(b, len(REASONING))] if a < len(REASONING) else ""
        c = text[max(a, len(REASONING)):b]
        deltas.append(OutputDelta(content=c, reasoning=r))
    call = ToolCallDelta(0, "call_1", "f", '{"x": 1}')
    assert segments(deltas + [OutputDelta(content="  \n", tool_calls=[call])]) == [
        ("reasoning", REASONING), ("content", ANSWER + "  \n"), ("tool_call", 'f{"x": 1}')
    ]


def test_blank_text_between_segments_is_no_segment_of_its_own():
    deltas = [OutputDelta(reasoning="a"), OutputDelta(content="\n\n"),
              OutputDelta(tool_calls=[ToolCallDelta(0, "c0", "f", "{}")]), OutputDelta(content=" "),
              OutputDelta(tool_calls=[ToolCallDelta(1, "c1", "g", "{}")]), OutputDelta(reasoning="\n")]
    assert segments(deltas) == [("reasoning", "a"), ("tool_call", "f{}"), ("tool_call", "g{}")]


def test_each_tool_call_index_is_a_segment_of_its_own():
    deltas = [OutputDelta(tool_calls=[ToolCallDelta(0, "c0", "f", '{"a"'), ToolCallDelta(0, arguments=": 1}"),
                                      ToolCallDelta(1, "c1", "f", "{}")])]
    assert segments(deltas) == [("tool_call", 'f{"a": 1}'), ("tool_call", "f{}")]


def test_a_chat_error_is_renamed_to_the_field_it_came_from():
    t = ChatTranslation()
    t.add({"role": "system", "content": "s"}, "system")
    t.add({"role": "tool", "content": "r"}, "messages[1].content[0]")
    t.add({"role": "user", "content": []}, "messages[1]", parts=[1, 3])
    err = t.rename(APIError(400, "messages[2].content[1]: no images", param="messages[2].content[1]"), {})
    assert (err.param, err.message) == ("messages[1].content[3]", "messages[1].content[3]: no images")
    err = t.rename(APIError(400, "stop: too many", param="stop"), {"stop": "stop_sequences"})
    assert (err.param, err.message) == ("stop_sequences", "stop_sequences: too many")
    err = t.rename(APIError(400, "messages[0]: bad", param="messages[0]"), {})
    assert err.param == "system"
