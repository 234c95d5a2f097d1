"""Output grammars: they accept what each tool-call format writes, and whatever they let a model
write parses back into valid calls (checked by random walks through the grammar)."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_server.engine.guidance import GrammarProcessor, ll_tokenizer, special_token
from mlx_server.text.chat_output import ChatOutput, OutputConfig
from mlx_server.text.grammar import CALL_SYNTAX, OutputShape, closed, output_grammar
from mlx_server.text.tool_calls import tool_format
from unit.test_tool_calls import SAMPLES, TOOLS

SAMPLED = sorted(set(CALL_SYNTAX) & set(SAMPLES))  # formats whose sample is "Checking." then calls

THINK = ("<think>", "</think>")
# Small closed choices, so that random walks through the grammar finish.
WALK_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                       "metric": {"type": "boolean"}},
        "required": ["city"],
    }}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"]}}},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Ada", "Alan"]},
        "langs": {"type": "array", "items": {"enum": ["en", "fr"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["qwen3", "smollm2"])
def tokenizer(request, qwen3_tokenizer, tiny_model_dir):
    """Qwen3's (markers are special tokens) and SmolLM2's (markers are plain text)."""
    if request.param == "qwen3":
        return qwen3_tokenizer
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir)


def grammar(tokenizer, fmt_name=None, tools=None, required=False, parallel=True, schema=None, think=THINK):
    fmt = tool_format(fmt_name) if fmt_name else None
    shape = OutputShape(
        reasoning_markers=think,
        tool_format=(fmt.name, fmt.start, fmt.end) if fmt else None,
        tools=tools,
        tools_required=required,
        parallel_tool_calls=parallel,
        json_schema=schema,
    )
    return output_grammar(shape, lambda text: special_token(tokenizer, text))


def accepts(tokenizer, lark: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = ll_tokenizer(tokenizer).tokenize_str(text, parse_special=True)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def walk(tokenizer, lark: str, rng: random.Random, max_tokens: int = 150) -> str | None:
    """A random text the grammar allows, or None if it did not end within max_tokens."""
    ll = ll_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(ll, lark, log_level=0)
    mask = allocate_token_bitmask(1, ll.vocab_size)
    eos = set(tokenizer.eos_token_ids)
    out = []
    for _ in range(max_tokens):
        fill_next_token_bitmask(matcher, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: ll.vocab_size])
        if eos & set(allowed.tolist()) and (len(allowed) == 1 or rng.random() < 0.5):
            return tokenizer.decode(out)
        token = int(rng.choice([t for t in allowed.tolist() if t not in eos]))
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return None


def parse(fmt_name: str, text: str):
    out = ChatOutput(OutputConfig(reasoning_markers=THINK, tool_format=tool_format(fmt_name), tools=WALK_TOOLS))
    return out.feed(text) + out.finish()


@pytest.mark.parametrize("fmt", SAMPLED)
def test_required_grammar_accepts_the_formats_own_calls(tokenizer, fmt):
    calls_only = SAMPLES[fmt].removeprefix("Checking.")
    assert accepts(tokenizer, grammar(tokenizer, fmt, TOOLS, required=True), calls_only)
    assert accepts(tokenizer, grammar(tokenizer, fmt, TOOLS, required=True), "<think>hm</think>\n\n" + calls_only)
    assert not accepts(tokenizer, grammar(tokenizer, fmt, TOOLS, required=True), SAMPLES[fmt]), "no text before calls"


def test_llama3_required_grammar_takes_its_calls_alone(tokenizer):
    calls = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
    lark = grammar(tokenizer, "llama3_json", TOOLS, required=True)
    assert accepts(tokenizer, lark, calls) and accepts(tokenizer, lark, "<think>hm</think>\n" + calls)
    assert not accepts(tokenizer, lark, "Checking. " + calls)
    assert not accepts(tokenizer, lark, '{"name": "nope", "parameters": {}}')
    single = grammar(tokenizer, "llama3_json", TOOLS, required=True, parallel=False)
    assert not accepts(tokenizer, single, calls)
    # `auto`: the answer is calls or text, and text admits calls: no grammar at all.
    assert grammar(tokenizer, "llama3_json", TOOLS, think=None) is None


@pytest.mark.parametrize("fmt", SAMPLED)
def test_auto_grammar_accepts_text_then_calls_and_plain_text(tokenizer, fmt):
    lark = grammar(tokenizer, fmt, TOOLS)
    assert accepts(tokenizer, lark, SAMPLES[fmt])
    assert accepts(tokenizer, lark, "Just an answer, no calls.")


def test_auto_grammar_forces_a_valid_call_once_one_starts(tokenizer):
    lark = grammar(tokenizer, "json_tools", TOOLS)
    assert not accepts(tokenizer, lark, 'Sure. <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')


def test_single_call_grammar_refuses_a_second_call(tokenizer):
    lark = grammar(tokenizer, "json_tools", TOOLS, required=True, parallel=False)
    one, two = SAMPLES["json_tools"].removeprefix("Checking.\n\n").split("\n<tool_call>")
    assert accepts(tokenizer, lark, one)
    assert not accepts(tokenizer, lark, one + "\n<tool_call>" + two)


@pytest.mark.parametrize("fmt", sorted(CALL_SYNTAX))
@pytest.mark.parametrize("parallel", [True, False])
def test_whatever_the_tool_grammar_allows_parses_into_valid_calls(qwen3_tokenizer, fmt, parallel):
    lark = grammar(qwen3_tokenizer, fmt, WALK_TOOLS, required=True, parallel=parallel, think=None)
    rng = random.Random(f"{fmt}{parallel}")
    finished = 0
    for _ in range(6):
        text = walk(qwen3_tokenizer, lark, rng)
        if text is None:
            continue
        finished += 1
        delta = parse(fmt, text)
        calls = {}
        for d in delta.tool_calls:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
        assert calls and delta.content == "", text
        assert parallel or len(calls) == 1
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WALK_TOOLS}
        for name, arguments in calls.values():
            jsonschema.validate(json.loads(arguments), schemas[name])
    assert finished >= 3


def test_whatever_the_json_grammar_allows_parses_and_validates(tokenizer):
    lark = grammar(tokenizer, schema=PERSON, think=None)
    rng = random.Random(1)
    texts = [t for t in (walk(tokenizer, lark, rng) for _ in range(8)) if t is not None]
    assert len(texts) >= 4
    for text in texts:
        out = ChatOutput(OutputConfig(reasoning_markers=THINK))
        delta = out.feed(text) + out.finish()
        jsonschema.validate(json.loads(delta.content), PERSON)


def test_nothing_to_constrain_is_no_grammar(tokenizer):
    assert grammar(tokenizer) is None
    assert grammar(tokenizer, "gemma4", TOOLS, required=True) is None  # a format without a grammar


def test_tool_schemas_are_closed_to_undeclared_keys():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "properties": {"type": "string"}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["properties"] == {"type": "string"}, "a parameter named 'properties' is not a schema keyword"
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True


def test_processor_masks_logits_with_portable_mx_ops(qwen3_tokenizer):
    """llguidance.mlx needs Metal; the processor applies the mask with mx.where on any device."""
    lark = grammar(qwen3_tokenizer, schema={"enum": ["yes"]}, think=None)
    processor = GrammarProcessor(qwen3_tokenizer, lark)
    sample = processor.sampler(lambda logprobs: mx.argmax(logprobs, axis=-1))
    width = 151936 + 64  # models pad their vocabulary
    logits = processor(mx.array([1, 2, 3]), mx.zeros((1, width)))
    allowed = np.flatnonzero(np.isfinite(np.array(logits[0])))
    assert [qwen3_tokenizer.decode([int(t)]) for t in allowed] == ['"']  # the forced start of "yes"
    sample(logits)
    logits = processor(mx.array([1, 2, 3, int(allowed[0])]), mx.zeros((1, width)))
    allowed = np.flatnonzero(np.isfinite(np.array(logits[0])))
    assert all(qwen3_tokenizer.decode([int(t)]) in ("yes", "y", "ye", 'yes"') for t in allowed)
