"""Generation semantics through a real server: stop strings, max_tokens, the context window, sampling."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

CHAT = "/v1/chat/completions"
# The tiny model may end early at random: forbidding its end tokens makes lengths exact.
NO_EOS = {"0": -100, "2": -100}


def ask(client, content="Tell me about the sea.", **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(body):
    return body["choices"][0]["message"]["content"]


def stream_text(client, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0, "stream": True, **fields}
    chunks = []
    with client.stream("POST", CHAT, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, chunks[-1]


@pytest.fixture(scope="module")
def reference(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        return text_of(ask(c, max_tokens=40, logit_bias=NO_EOS))


def test_max_tokens_gives_exactly_that_many_tokens_and_length(client):
    body = ask(client, max_tokens=5, logit_bias=NO_EOS)
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field", ["max_completion_tokens", "n_predict"])
def test_other_names_of_max_tokens(client, field):
    body = ask(client, **{field: 3}, logit_bias=NO_EOS)
    assert body["usage"]["completion_tokens"] == 3


def test_greedy_is_deterministic(client, reference):
    assert text_of(ask(client, max_tokens=40, logit_bias=NO_EOS)) == reference


def test_stop_string_spanning_tokens_ends_output_and_is_not_emitted(client, reference):
    cut = len(reference) // 2
    stop = reference[cut : cut + 4]
    first = reference.index(stop)
    body = ask(client, max_tokens=40, logit_bias=NO_EOS, stop=stop)
    assert text_of(body) == reference[:first]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stop_list_first_match_wins_streaming_too(client, reference):
    a, b = reference[10:13], reference[25:29]
    end = min(reference.index(a) + len(a), reference.index(b) + len(b))
    expected_cut = reference.index(a) if reference.index(a) + len(a) == end else reference.index(b)
    text, final = stream_text(client, max_tokens=40, logit_bias=NO_EOS, stop=[b, a])
    assert text == reference[:expected_cut]
    assert final["choices"][0]["finish_reason"] == "stop"


def test_stop_that_never_occurs_changes_nothing(client, reference):
    assert text_of(ask(client, max_tokens=40, logit_bias=NO_EOS, stop=["\u2603never\u2603"])) == reference


def test_completion_stops_with_length_at_the_context_window(client):
    body = ask(client, content="sea " * 990, logit_bias=NO_EOS)  # tiny_server runs with --ctx-size 1024
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 1024
    assert body["choices"][0]["finish_reason"] == "length"


def test_max_tokens_beyond_the_window_is_clamped_to_it(client):
    body = ask(client, content="sea " * 990, max_tokens=500, logit_bias=NO_EOS)
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 1024


def test_same_seed_same_sample_different_seed_different_sample(client):
    def sample(seed):
        return text_of(ask(client, max_tokens=24, temperature=1.0, seed=seed, logit_bias=NO_EOS))

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_sampling_knobs_are_accepted_and_change_nothing_when_neutral(client, reference):
    neutral = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert text_of(ask(client, max_tokens=40, logit_bias=NO_EOS, **neutral)) == reference


def test_top_k_1_is_greedy_even_at_high_temperature(client, reference):
    assert text_of(ask(client, max_tokens=40, logit_bias=NO_EOS, temperature=1.5, top_k=1)) == reference


def test_repetition_penalty_changes_greedy_output(client, reference):
    assert text_of(ask(client, max_tokens=40, logit_bias=NO_EOS, repetition_penalty=1.8)) != reference


def test_logit_bias_forces_a_token(client):
    tok = "1000"
    body = ask(client, max_tokens=4, logit_bias={**NO_EOS, tok: 100})
    assert body["usage"]["completion_tokens"] == 4
    body2 = ask(client, max_tokens=4, logit_bias={**NO_EOS, "1001": 100})
    assert text_of(body) != text_of(body2)


def test_concurrent_requests_all_get_their_own_correct_answer(tiny_server):
    prompts = ["Tell me about the sea.", "What is a cat?", "Count to five.", "Name a color."]
    with httpx.Client(base_url=tiny_server.url, timeout=300) as c:
        sequential = [text_of(ask(c, content=p, max_tokens=16, logit_bias=NO_EOS)) for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        with httpx.Client(base_url=tiny_server.url, timeout=300) as c:
            results[i] = text_of(ask(c, content=prompts[i], max_tokens=16, logit_bias=NO_EOS))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential


def test_health_answers_while_a_long_generation_runs(tiny_server):
    body = {"model": "m", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 300, "stream": True, "logit_bias": NO_EOS}
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        with c.stream("POST", CHAT, json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if '"content"' in line)
            assert httpx.get(tiny_server.url + "/health", timeout=5).json() == {"status": "ok"}
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) > 10  # the generation was still running when /health answered
