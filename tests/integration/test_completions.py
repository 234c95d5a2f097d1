"""Legacy completions through the official `openai` SDK and raw HTTP, and /tokenize, /detokenize."""

from __future__ import annotations

import json

import openai
import pytest

from openai_schema import assert_valid

PROMPT = "Once upon a time"
# The tiny model may end early at random: forbidding its end tokens makes lengths exact.
NO_EOS = {"0": -100, "2": -100}
GREEDY = {"temperature": 0, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_create_matches_openai_schema_and_max_tokens(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 7, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_valid("CreateCompletionResponse", body)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 7
    assert body["timings"]["predicted_n"] == 7


def test_default_max_tokens_is_sixteen(client):
    body = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, **GREEDY}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_sdk_streaming_and_not_give_the_same_text(sdk):
    whole = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, extra_body={"logit_bias": NO_EOS}, temperature=0)
    chunks = list(sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stream=True, temperature=0,
                                         extra_body={"logit_bias": NO_EOS}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 10


def test_final_stream_chunk_matches_openai_schema(client):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    lines = [l for l in client.post("/v1/completions", json=body).text.split("\n\n") if l]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: "):])
    assert_valid("CreateCompletionResponse", final)


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4, **GREEDY}).json()
    echoed = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4, "echo": True, **GREEDY}).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


def test_each_prompt_of_a_list_is_a_choice_streaming_too(client, sdk):
    single = client.post("/v1/completions", json={"model": "m", "prompt": "The sea", "max_tokens": 5, **GREEDY}).json()
    body = client.post("/v1/completions", json={"model": "m", "prompt": [PROMPT, "The sea"], "max_tokens": 5, **GREEDY}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["text"] == single["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 10
    chunks = list(sdk.completions.create(model="tiny", prompt=[PROMPT, "The sea"], max_tokens=5, stream=True,
                                         temperature=0, extra_body={"logit_bias": NO_EOS}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [c["text"] for c in body["choices"]]
    assert chunks[-1].usage.completion_tokens == 10


def test_token_prompt_completes_like_its_text(client):
    tokens = client.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_text = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 6, **GREEDY}).json()
    by_tokens = client.post("/v1/completions", json={"model": "m", "prompt": tokens, "max_tokens": 6, **GREEDY}).json()
    assert by_tokens["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_tokens["usage"]["prompt_tokens"] == len(tokens)


def test_stop_ends_a_completion(client):
    text = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 12, **GREEDY}).json()["choices"][0]["text"]
    stop = text[4:7]
    body = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "stop": stop, **GREEDY}).json()
    assert body["choices"][0] == {"index": 0, "text": text[: text.index(stop)], "logprobs": None, "finish_reason": "stop"}


def test_tokenize_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert "".join(p["piece"] for p in r["tokens"]) == "Hello world"
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    ids = [p["id"] for p in r["tokens"]]
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"


def test_tokenize_messages_counts_the_chat_prompt(client):
    messages = [{"role": "user", "content": "Say hello."}]
    count = client.post("/tokenize", json={"messages": messages}).json()["count"]
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1}).json()
    assert count == chat["usage"]["prompt_tokens"]


def completion_logprobs(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 8, **GREEDY, **body})
    assert r.status_code == 200, r.text
    assert_valid("CreateCompletionResponse", r.json())
    return r.json()


def test_logprobs_give_each_tokens_logprob_top_alternatives_and_offset(client):
    body = completion_logprobs(client, logprobs=2)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert body["usage"]["completion_tokens"] == 8
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and logprob <= 0
        assert top[token] == logprob == max(top.values())  # greedy: the most likely token
    # OpenAI counts offsets from the prompt's start, echoed or not.
    starts = [len(PROMPT) + len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    assert lp["text_offset"] == starts


def test_logprobs_zero_gives_the_sampled_tokens_alone(client):
    lp = completion_logprobs(client, logprobs=0)["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    whole = completion_logprobs(client, logprobs=2)["choices"][0]["logprobs"]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "stream": True, "logprobs": 2, **GREEDY}
    frames = [l for l in client.post("/v1/completions", json=body).text.split("\n\n") if l]
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    streamed = {key: [] for key in whole}
    for c in chunks:
        (choice,) = c["choices"]
        # OpenAI's schema has no streamed chunk: a chunk is a response whose finish_reason may be null.
        assert_valid("CreateCompletionResponse", {**c, "choices": [{**choice, "finish_reason": "length"}]})
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]  # each chunk carries its text's tokens
        for key in whole:
            streamed[key] += choice["logprobs"][key]
    assert streamed == whole


def test_logprobs_leave_out_a_stop_strings_tokens(client):
    whole = completion_logprobs(client, logprobs=1)["choices"][0]
    stop = whole["text"][4:7]
    body = completion_logprobs(client, logprobs=1, stop=stop)
    choice = body["choices"][0]
    assert choice["text"] == whole["text"][: whole["text"].index(stop)] and choice["finish_reason"] == "stop"
    # The tokens that start in the text, and none of those that only wrote the stop string.
    kept = sum(1 for offset in whole["logprobs"]["text_offset"] if offset < len(PROMPT) + len(choice["text"]))
    assert choice["logprobs"] == {key: values[:kept] for key, values in whole["logprobs"].items()}
    assert kept < body["usage"]["completion_tokens"]


def test_logprobs_with_echo_is_a_400_naming_logprobs(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "echo" in r.json()["error"]["message"]


def test_logprobs_over_5_is_a_400(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_token_that_splits_a_character_is_written_as_its_bytes():
    from mlx_server.api.completions.serving import LegacyLogprobs
    from mlx_server.engine.request import TokenLogprob

    logprobs = LegacyLogprobs(start=3)
    assert logprobs.feed("", [TokenLogprob(b" \xe2\x80", -0.5)])["tokens"] == []  # no text yet: held
    sent = logprobs.feed(" \u2019s", [TokenLogprob(b"\x99s", -1.0)])
    assert sent["tokens"] == ["bytes:\\x20\\xe2\\x80", "bytes:\\x99\\x73"]
    assert sent["text_offset"] == [3, 4]
