"""ToolCallParser: every mlx-lm tool-call format, the same calls whatever the chunking."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from mlx_server.text.chat_output import ChatOutput, OutputConfig
from mlx_server.text.tool_calls import ToolCallParser, tool_format, tool_format_names

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    }}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}},
    }}},
]

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"tz": "CET"})

# What each format's model writes for: "Checking." then get_weather(Paris, 3) and get_time(CET).
SAMPLES = {
    "json_tools": (
        'Checking.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    ),
    "qwen3_coder": (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>"
    ),
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}get_time[ARGS]{"tz": "CET"}',
    "pythonic": 'Checking.<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(tz="CET")]<|tool_call_end|>',
    "glm47": (
        "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"
    ),
    "laguna": (
        "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"
    ),
    "longcat": (
        "Checking.<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key>"
        "<longcat_arg_value>Paris</longcat_arg_value><longcat_arg_key>days</longcat_arg_key>"
        "<longcat_arg_value>3</longcat_arg_value></longcat_tool_call>"
        "<longcat_tool_call>get_time<longcat_arg_key>tz</longcat_arg_key>"
        "<longcat_arg_value>CET</longcat_arg_value></longcat_tool_call>"
    ),
    "kimi_k2": (
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    ),
    "kimi_k3": (
        'Checking.<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_time" index="2"<|sep|>'
        '<|open|>argument key="tz" type="string"<|sep|>CET<|close|>argument<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|>"
    ),
    "minimax_m2": (
        'Checking.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n'
        '<parameter name="tz">CET</parameter>\n</invoke>\n</minimax:tool_call>'
    ),
    "minicpm5": (
        'Checking.<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>'
        '<function name="get_time"><param name="tz">CET</param></function>'
    ),
    "muse_spark": (
        'Checking.<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>'
        '<atem:parameter name="days">3</atem:parameter></atem:invoke><atem:invoke name="get_time">'
        '<atem:parameter name="tz">CET</atem:parameter></atem:invoke></atem:function_calls>'
    ),
    "gemma4": (
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        '<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>'
    ),
    "function_gemma": (
        "Checking.<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>"
        "<start_function_call>call:get_time{tz:<escape>CET<escape>}<end_function_call>"
    ),
}


def run(fmt_name, pieces):
    """Feed the pieces; the content and the calls as (index, name, arguments) with ids checked."""
    parser = ToolCallParser(tool_format(fmt_name), TOOLS)
    content, deltas = "", []
    for p in pieces:
        c, d = parser.feed(p)
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    content, deltas = content + c, deltas + d
    calls = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.id.startswith("call_") and d.name, "a call's first delta carries its id and name"
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls))), "indexes are 0, 1, 2... in order"
    return content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


def every_split(text, step=1):
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            yield [text[:i], text[i:j], text[j:]]


# Llama 3.1-3.3 (ours): no markers; the whole answer is the calls, or it is content.
LLAMA3 = {
    "two calls after the tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        ("", [WEATHER, TIME]),
    ),
    "one call, leading whitespace": ('\n {"name": "get_time", "parameters": {"tz": "CET"}}\n', ("", [TIME])),
    "arguments key, as a JSON string": ('{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}', ("", [TIME])),
    "JSON that is not a call": ('{"answer": 42, "name": "x"}', ('{"answer": 42, "name": "x"}', [])),
    "text": ('The weather in Paris is {"name": "x"} sunny.', ('The weather in Paris is {"name": "x"} sunny.', [])),
    "a prefix of the tag": ("<|pyth", ("<|pyth", [])),
}


def test_every_mlx_lm_format_has_a_sample():
    assert set(SAMPLES) | {"llama3_json"} == set(tool_format_names())


@pytest.mark.parametrize("case", sorted(LLAMA3))
def test_llama3_calls_are_the_whole_answer_or_it_is_content(case):
    text, expected = LLAMA3[case]
    assert run("llama3_json", [text]) == expected
    for i in range(len(text) + 1):
        assert run("llama3_json", [text[:i], text[i:]]) == expected, i
    assert run("llama3_json", list(text)) == expected


def test_llama3_format_is_inferred_from_the_llama_3_1_template():
    from types import SimpleNamespace

    from mlx_server.text.tool_calls import infer_tool_format

    tok = SimpleNamespace(init_kwargs={}, get_vocab=lambda: {})
    template = ('{%- if builtin_tools is defined %}<|python_tag|>{%- endif %}Respond in the format '
                '{"name": function name, "parameters": dictionary of argument name and its value}.')
    assert infer_tool_format(tok, template) == "llama3_json"
    assert infer_tool_format(tok, "{{ messages }} <tool_call> {{ tool_call.name }}") == "json_tools"
    assert infer_tool_format(tok, "{{ messages }}") is None


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_each_format_parses_two_calls_and_keeps_the_content(fmt):
    assert run(fmt, [SAMPLES[fmt]]) == ("Checking.", [WEATHER, TIME])


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_each_format_gives_the_same_result_cut_at_every_boundary(fmt):
    text = SAMPLES[fmt]
    expected = run(fmt, [text])
    for i in range(len(text) + 1):
        assert run(fmt, [text[:i], text[i:]]) == expected, i
    assert run(fmt, list(text)) == expected


def test_json_calls_cut_three_ways_at_every_boundary():
    text = SAMPLES["json_tools"]
    expected = run("json_tools", [text])
    for pieces in every_split(text, step=3):
        assert run("json_tools", pieces) == expected, pieces


def test_json_call_streams_name_first_then_arguments_as_generated():
    parser = ToolCallParser(tool_format("json_tools"), TOOLS)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci') [1][0].name == "get_weather"
    _, deltas = parser.feed('ty": "Pa')
    assert [d.arguments for d in deltas] == ['ty": "Pa']
    _, deltas = parser.feed('ris"}}\n</tool_call>')
    assert [d.arguments for d in deltas] == ['ris"}']


def test_json_call_with_arguments_before_name_is_parsed_whole():
    text = '<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>'
    assert run("json_tools", [text]) == ("", [TIME])


def test_text_that_is_not_a_call_is_content_after_all():
    text = "a <tool_call>not json</tool_call> b"
    assert run("json_tools", [text]) == (text, [])


def test_call_cut_off_by_the_end_of_output_keeps_what_was_streamed():
    parser = ToolCallParser(tool_format("json_tools"), TOOLS)
    _, deltas = parser.feed('<tool_call>\n{"name": "get_time", "arguments": {"tz": "C')
    assert parser.finish() == ("", [])
    assert "".join(d.arguments for d in deltas) == '{"tz": "C'


def test_unfinished_marker_at_the_end_is_content():
    assert run("json_tools", ["answer <tool_"]) == ("answer <tool_", [])


def test_chat_output_splits_reasoning_then_calls():
    out = ChatOutput(OutputConfig(reasoning_markers=("<think>", "</think>"), tool_format=tool_format("json_tools"), tools=TOOLS))
    text = "<think>\nneed weather\n</think>\n\n" + SAMPLES["json_tools"]
    delta = out.feed(text) + out.finish()
    assert delta.reasoning == "need weather"
    assert delta.content == "Checking."
    assert [c.name for c in delta.tool_calls if c.name] == ["get_weather", "get_time"]
    assert out.tool_calls_seen == 2


def test_chat_output_without_config_passes_text_through():
    out = ChatOutput()
    assert (out.feed("<think>x</think><tool_call>") + out.finish()).content == "<think>x</think><tool_call>"


@settings(max_examples=200)
@given(
    fmt=st.sampled_from(sorted(SAMPLES)),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_property_any_chunking_gives_the_same_calls(fmt, cuts):
    text = SAMPLES[fmt]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(fmt, pieces) == run(fmt, [text])
