"""Legacy completions prompts: every accepted form, fill-in-the-middle, and bad token ids."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_server.api.completions.protocol import CompletionRequest
from mlx_server.api.completions.serving import FIM_MARKERS, CompletionServing, fim_markers
from mlx_server.api.errors import APIError
from protocol_fakes import chat_serving


@pytest.fixture(scope="module")
def serving(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    return CompletionServing(chat_serving(tokenizer))


def prompts(serving, prompt, **fields):
    return serving.prompts(CompletionRequest.model_validate({"model": "m", "prompt": prompt, **fields}))


def test_every_prompt_form_gives_one_prompt_per_choice(serving):
    hello = serving.tokenizer.encode("Hello")
    assert prompts(serving, "Hello") == [("Hello", hello)]
    assert [t for _, t in prompts(serving, ["Hello", "Bye"])] == [hello, serving.tokenizer.encode("Bye")]
    assert prompts(serving, hello) == [("Hello", hello)]
    assert prompts(serving, [hello, hello]) == [("Hello", hello)] * 2


def test_an_empty_prompt_is_a_document_boundary(serving):
    assert prompts(serving, "") == [("", [serving.tokenizer.bos_token_id])]


@pytest.mark.parametrize("prompt,param", [([], "prompt"), ([[]], "prompt"), ([5, 10 ** 9], "prompt"), ([[5], [10 ** 9]], "prompt[1]")])
def test_bad_token_prompts_are_400s_naming_the_prompt(serving, prompt, param):
    with pytest.raises(APIError) as e:
        prompts(serving, prompt)
    assert (e.value.status, e.value.param) == (400, param)


def test_suffix_without_fill_in_the_middle_tokens_is_a_400(serving):
    assert serving.fim is None  # SmolLM2 has none
    with pytest.raises(APIError) as e:
        prompts(serving, "def f(", suffix="):")
    assert e.value.param == "suffix" and "fill-in-the-middle" in e.value.message


def test_suffix_makes_a_prefix_suffix_middle_prompt(serving, monkeypatch):
    monkeypatch.setattr(serving, "fim", FIM_MARKERS[1])
    ((text, tokens),) = prompts(serving, "def f(", suffix="):\n    pass")
    assert text == "def f("
    assert serving.tokenizer.decode(tokens) == "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>"


@pytest.mark.parametrize("markers", FIM_MARKERS)
def test_fim_markers_are_found_in_a_vocabulary(markers):
    assert fim_markers({m: i for i, m in enumerate(markers)} | {"a": 9}) == markers
    assert fim_markers({"a": 0, markers[0]: 1}) is None
