"""Images and video on a real vision pipeline (SPEC §7): a SmolVLM built from SmolLM2's real text
weights and a small random vision tower (tests/tiny_smolvlm.py), served as a real process."""

from __future__ import annotations

import base64
import http.server
import threading
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from conftest import CACHE, ServerProcess
from openai_schema import assert_valid

QUESTION = "What is in this picture?"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="session")
def vlm_dir(tiny_model_dir) -> Path:
    import tiny_smolvlm

    return tiny_smolvlm.build_model(tiny_model_dir, CACHE / "models" / f"smolvlm-tiny-{tiny_smolvlm.version()}")


@pytest.fixture(scope="module")
def vlm_server(vlm_dir):
    server = ServerProcess("--model", str(vlm_dir), "--ctx-size", "2048", "--model-id", "smolvlm-tiny")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sdk(vlm_server):
    return openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(vlm_server):
    with httpx.Client(base_url=vlm_server.url, timeout=120) as c:
        yield c


def picture(seed: int, size=(64, 48)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """A folder of test media, made here with Pillow (and PyAV for the MP4)."""
    import av

    root = tmp_path_factory.mktemp("media")
    picture(0).save(root / "photo.png")
    picture(1).save(root / "other.png")
    frames = [picture(10 + i, (32, 32)) for i in range(4)]
    frames[0].save(root / "clip.gif", save_all=True, append_images=frames[1:], duration=100)
    with av.open(str(root / "clip.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for frame in frames * 3:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    (root / "notes.txt").write_text("not an image")
    with open(root / "huge.png", "wb") as f:  # over the default 20 MiB cap, without writing it all
        f.truncate(21 << 20)
    return root


@pytest.fixture(scope="module")
def http_media(media):
    """A local HTTP server for the media folder; /to-file redirects to a file:// URL."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(media), **kwargs)

        def do_GET(self):
            if self.path == "/to-file":
                self.send_response(302)
                self.send_header("Location", f"file://{media}/photo.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def ask(sdk, url: str, **extra):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return sdk.chat.completions.create(model="smolvlm-tiny", messages=[{"role": "user", "content": content}],
                                       logprobs=True, top_logprobs=2, **GREEDY, **extra)


def first_logprobs(completion) -> list[float]:
    return [t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs]


# ---- one image, every way of naming it ----


def test_same_image_as_file_url_path_data_url_and_http_gives_identical_greedy_output(sdk, media, http_media):
    path = media / "photo.png"
    answers = [ask(sdk, url) for url in (f"file://{path}", str(path), data_url(path), f"{http_media}/photo.png")]
    texts = {a.choices[0].message.content for a in answers}
    assert len(texts) == 1 and texts.pop()
    assert len({tuple(first_logprobs(a)) for a in answers}) == 1
    # The image really is in the prompt: SmolVLM tiles a 64x48 picture into 2x2 tiles plus the whole.
    text_only = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    assert answers[0].usage.prompt_tokens >= text_only.usage.prompt_tokens + 5 * 4


def test_anthropic_base64_image_block_gives_the_same_output(sdk, vlm_server, media):
    path = media / "photo.png"
    expected = ask(sdk, str(path)).choices[0].message.content
    client = anthropic.Anthropic(base_url=vlm_server.url, api_key="unused", max_retries=0)
    image = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(path.read_bytes()).decode()}
    message = client.messages.create(
        model="smolvlm-tiny", max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "image", "source": image}, {"type": "text", "text": QUESTION}]}],
    )
    assert message.content[0].text == expected
    counted = client.messages.count_tokens(
        model="smolvlm-tiny",
        messages=[{"role": "user", "content": [{"type": "image", "source": image}, {"type": "text", "text": QUESTION}]}],
    )
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_responses_input_image_gives_the_same_output(sdk, media):
    path = media / "photo.png"
    expected = ask(sdk, str(path)).choices[0].message.content
    response = sdk.responses.create(model="m", temperature=0, max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(path), "detail": "auto"}, {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected


def test_jan_images_array_is_the_image_before_the_text(sdk, client, media):
    path = media / "photo.png"
    expected = ask(sdk, str(path)).choices[0].message.content
    body = {"model": "m", **GREEDY, "messages": [{"role": "user", "content": QUESTION, "images": [f"file://{path}"]}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected


def test_a_different_image_changes_what_the_model_sees(sdk, media):
    assert first_logprobs(ask(sdk, str(media / "photo.png"))) != first_logprobs(ask(sdk, str(media / "other.png")))


def test_streaming_with_an_image_equals_the_whole_answer(sdk, media):
    path = str(media / "photo.png")
    whole = ask(sdk, path).choices[0].message.content
    content = [{"type": "image_url", "image_url": {"url": path}}, {"type": "text", "text": QUESTION}]
    stream = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_stop_strings_apply_to_image_answers(sdk, media):
    whole = ask(sdk, str(media / "photo.png")).choices[0].message.content
    stop = whole.strip()[:2]
    cut = ask(sdk, str(media / "photo.png"), stop=[stop]).choices[0]
    assert stop not in cut.message.content and cut.finish_reason == "stop"


def test_second_turn_reuses_the_image_instead_of_encoding_it_again(sdk, vlm_server, media):
    image = {"type": "image_url", "image_url": {"url": str(media / "other.png")}}
    turn1 = [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}]
    first = sdk.chat.completions.create(model="m", messages=turn1, **GREEDY)
    encoded = sum("vision: encoded" in line for line in vlm_server.lines)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the colours?"}]
    second = sdk.chat.completions.create(model="m", messages=turn2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert sum("vision: encoded" in line for line in vlm_server.lines) == encoded


# ---- video ----


def test_video_from_the_videos_array_and_a_video_url_part(client, media):
    def prompt_tokens(message: dict) -> int:
        r = client.post("/v1/chat/completions", json={"model": "m", **GREEDY, "messages": [message]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    text_only = prompt_tokens({"role": "user", "content": "What happens?"})
    gif = prompt_tokens({"role": "user", "content": "What happens?", "videos": [str(media / "clip.gif")]})
    mp4 = prompt_tokens({"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": f"file://{media}/clip.mp4"}}, {"type": "text", "text": "What happens?"}]})
    # Each 32x32 frame is one tile of 4 image tokens plus its markers: 4 frames of the GIF, 8 of the MP4.
    assert gif > text_only + 4 * 4
    assert mp4 > gif + 4 * 4


# ---- the text path of a vision model, and the model list ----


def test_text_only_request_to_a_vision_model(sdk):
    completion = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], **GREEDY)
    assert completion.choices[0].message.content and completion.usage.completion_tokens == 8


def test_models_list_says_the_model_takes_images(client):
    body = client.get("/v1/models").json()
    assert_valid("ListModelsResponse", body)
    assert body["data"][0]["input_modalities"] == ["text", "image", "video"]


def test_text_only_model_lists_text_input_only(tiny_server):
    body = httpx.get(tiny_server.url + "/v1/models").json()
    assert_valid("ListModelsResponse", body)
    assert body["data"][0]["input_modalities"] == ["text"]


# ---- errors: a 400 naming the part, and the server goes on ----

ERRORS = {
    "missing file": (lambda m, h: str(m / "missing.png"), "no such file"),
    "a directory": (lambda m, h: f"file://{m}", "is not a file"),
    "not an image": (lambda m, h: str(m / "notes.txt"), "not an image"),
    "corrupt base64": (lambda m, h: "data:image/png;base64,iVBORw0KGgo@@@", "base64 payload is corrupt"),
    "base64 of no image": (lambda m, h: "data:image/png;base64," + base64.b64encode(b"hello").decode(), "not an image"),
    "over the size cap": (lambda m, h: str(m / "huge.png"), "over the 20 MiB limit"),
    "relative path": (lambda m, h: "photo.png", "not an absolute path"),
    "other scheme": (lambda m, h: "ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
    "http 404": (lambda m, h: f"{h}/nowhere.png", "HTTP 404"),
    "redirect to file://": (lambda m, h: f"{h}/to-file", "non-http URL"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_unusable_image_is_a_400_naming_the_part(client, media, http_media, case):
    make_url, words = ERRORS[case]
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": make_url(media, http_media)}}]
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400
    assert_valid("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and words in error["message"], error
    assert client.get("/health").status_code == 200


def test_unusable_video_is_a_400_naming_the_array_entry(client, media):
    message = {"role": "user", "content": "What happens?", "videos": [str(media / "clip.gif"), str(media / "notes.txt")]}
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [message]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].videos[1]"


def test_anthropic_corrupt_image_block_is_an_anthropic_400(vlm_server):
    client = anthropic.Anthropic(base_url=vlm_server.url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, block]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in err.value.body["error"]["message"]


def test_image_to_a_text_only_model_is_a_400(tiny_server, media):
    content = [{"type": "image_url", "image_url": {"url": str(media / "photo.png")}}, {"type": "text", "text": "Hi"}]
    for message in ({"role": "user", "content": content}, {"role": "user", "content": "Hi", "images": [str(media / "photo.png")]}):
        r = httpx.post(tiny_server.url + "/v1/chat/completions", json={"model": "m", "messages": [message]}, timeout=60)
        assert r.status_code == 400
        assert "text-only" in r.json()["error"]["message"]
    assert httpx.get(tiny_server.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def local_only_server(vlm_dir):
    server = ServerProcess("--model", str(vlm_dir), "--no-remote-media", "--max-media-size", "1K")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_no_remote_media_and_a_smaller_size_cap(local_only_server, media, http_media):
    def error(url: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url}}]
        r = httpx.post(local_only_server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400
        return r.json()["error"]

    assert "remote media fetches are turned off" in error(f"{http_media}/photo.png")["message"]
    assert "over the 1 KiB limit" in error(str(media / "photo.png"))["message"]
    assert "more than the 1 KiB limit" in error(data_url(media / "photo.png"))["message"]
    assert httpx.get(local_only_server.url + "/health").status_code == 200
