"""media.py: every way of naming an image or a video, and every way it can be unusable."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from mlx_server.api.images import load_media, template_content
from mlx_server.api.errors import APIError
from mlx_server.media import MediaError, MediaPolicy, load_image, load_video, read_media


def png_bytes(color=(200, 30, 30), size=(8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "a b.png"  # a space: file:// URLs carry it percent-encoded
    path.write_bytes(png_bytes())
    return path


def test_file_url_plain_path_and_data_url_read_the_same_bytes(png):
    data = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    urls = [png.as_uri(), str(png), f"file://{png}", data, "  " + data + "\n"]
    assert {read_media(u, MediaPolicy()) for u in urls} == {png.read_bytes()}


def test_same_picture_by_any_url_has_one_digest(png):
    data = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    a, b = load_image(str(png)), load_image(data)
    assert a.digest == b.digest and a.size == (8, 6) and a.image.mode == "RGB"


def test_a_different_picture_has_another_digest(tmp_path, png):
    other = tmp_path / "b.png"
    other.write_bytes(png_bytes(color=(0, 0, 255)))
    assert load_image(str(png)).digest != load_image(str(other)).digest


@pytest.mark.parametrize("url, words", [
    ("", "empty"),
    ("picture.png", "not an absolute path"),
    ("ftp://host/a.png", "unsupported URL scheme 'ftp'"),
    ("file://otherhost/a.png", "local file"),
    ("data:image/png,abc", "only base64"),
    ("data:image/png;base64", "needs a comma"),
    ("data:image/png;base64,$$$$", "corrupt"),
    ("/no/such/file.png", "no such file"),
])
def test_unusable_urls_say_why(url, words):
    with pytest.raises(MediaError, match=words):
        load_image(url)


def test_size_caps_apply_to_files_and_data_urls(png):
    policy = MediaPolicy(max_bytes=16)
    with pytest.raises(MediaError, match="over the 16 bytes limit"):
        load_image(str(png), policy)
    with pytest.raises(MediaError, match="more than the 16 bytes limit"):
        load_image("data:image/png;base64," + base64.b64encode(png.read_bytes()).decode(), policy)


def test_pixel_cap_stops_decompression_bombs(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(png_bytes(size=(100, 100)))
    with pytest.raises(MediaError, match="pixel limit"):
        load_image(str(path), MediaPolicy(max_pixels=5000))


def test_truncated_and_non_images_are_refused(tmp_path):
    (tmp_path / "cut.png").write_bytes(png_bytes()[:40])
    (tmp_path / "text.png").write_text("hello")
    with pytest.raises(MediaError):
        load_image(str(tmp_path / "cut.png"))
    with pytest.raises(MediaError, match="not an image"):
        load_image(str(tmp_path / "text.png"))


def test_remote_fetches_can_be_turned_off():
    with pytest.raises(MediaError, match="turned off"):
        load_image("https://example.com/a.png", MediaPolicy(allow_remote=False))


def test_animated_gif_gives_evenly_spaced_frames(tmp_path):
    frames = [Image.new("RGB", (4, 4), (i * 20, 0, 0)) for i in range(10)]
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50)
    picked = load_video(str(path), MediaPolicy(max_video_frames=4))
    assert [f.image.getpixel((0, 0))[0] for f in picked] == [0, 60, 120, 180]
    assert len({f.digest for f in picked}) == 4
    assert len(load_video(str(path), MediaPolicy(max_video_frames=20))) == 10


def test_a_still_image_is_a_one_frame_video(png):
    assert len(load_video(str(png))) == 1


def test_load_media_expands_a_video_into_image_parts_in_order(tmp_path, png):
    frames = [Image.new("RGB", (4, 4), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:])
    messages = [{"role": "user", "content": [
        {"type": "image", "url": str(png), "param": "messages[0].images[0]"},
        {"type": "video", "url": str(tmp_path / "clip.gif"), "param": "messages[0].videos[0]"},
        {"type": "text", "text": "Hi"},
    ]}]
    images = load_media(messages, MediaPolicy())
    assert len(images) == 4
    assert [p["type"] for p in messages[0]["content"]] == ["image"] * 4 + ["text"]


def test_load_media_names_the_part_at_fault(png):
    messages = [{"role": "user", "content": [{"type": "image", "url": "/missing.png", "param": "messages[2].content[1]"}]}]
    with pytest.raises(APIError) as err:
        load_media(messages, MediaPolicy())
    assert err.value.status == 400 and err.value.param == "messages[2].content[1]"


def test_vision_template_content_is_always_a_list():
    image = {"type": "image", "url": "/a.png", "param": "p"}
    assert template_content([], "Hello", interleaved=True) == [{"type": "text", "text": "Hello"}]
    assert template_content([], "", interleaved=True) == [{"type": "text", "text": ""}]
    assert template_content([image], "", interleaved=True) == [image]
    text = {"type": "text", "text": "Hi"}
    assert template_content([text, image], "Hi", interleaved=True) == [text, image]
    assert template_content([image], "calls", interleaved=False) == [image, {"type": "text", "text": "calls"}]
