"""Images and videos named by URL: `file://` URLs, plain absolute paths, `data:` URLs and http(s).

Protocol-neutral: every API turns its image inputs (OpenAI `image_url` parts and `images`
arrays, Anthropic `image` blocks as data URLs, Responses `input_image`) into a URL string and
calls `load_image` / `load_video`. Failures are MediaError with a message a person can act on;
the caller adds which part of its request was at fault.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError


class MediaError(ValueError):
    """An image or video that cannot be used; the message says why."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote: bool = True  # --no-remote-media turns http(s) fetches off
    max_bytes: int = 20 << 20  # per image or video, as encoded
    timeout: float = 10.0  # seconds, for a whole remote fetch
    max_pixels: int = 40_000_000  # per image or frame, as decoded (decompression bombs)
    max_video_frames: int = 8  # frames sampled evenly from a video


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, fully decoded
    digest: str  # of the encoded bytes: the same picture sent as a path or a data URL is the same image

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def load_image(url_or_data: str, policy: MediaPolicy = MediaPolicy()) -> LoadedImage:
    """The image at a `file://` URL, absolute path, `data:` URL or http(s) URL, decoded to RGB."""
    data = read_media(url_or_data, policy)
    return LoadedImage(_decode_image(data, policy), hashlib.sha256(data).hexdigest())


def load_video(url_or_data: str, policy: MediaPolicy = MediaPolicy()) -> list[LoadedImage]:
    """Up to `policy.max_video_frames` frames, evenly spaced, of a video (or an animated image)."""
    data = read_media(url_or_data, policy)
    digest = hashlib.sha256(data).hexdigest()
    frames = _animated_frames(data, policy)
    if frames is None:
        frames = _container_frames(data, policy)
    if not frames:
        raise MediaError("the video has no frames")
    return [LoadedImage(f, f"{digest}:{i}") for i, f in enumerate(frames)]


def read_media(url: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes a media URL names, at most `policy.max_bytes` of them."""
    if not isinstance(url, str) or not url.strip():
        raise MediaError("the URL is empty")
    url = url.strip()
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    except ValueError:  # e.g. an unclosed IPv6 bracket: file://[
        raise MediaError(f"'{_short(url)}' is not a valid URL") from None
    if scheme == "data":
        return _read_data_url(url, policy)
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    if scheme == "file":
        return _read_file(_file_url_path(url), policy)
    if scheme:
        raise MediaError(f"unsupported URL scheme '{scheme}': use file://, an absolute path, data: or http(s)://")
    if not os.path.isabs(url):
        raise MediaError(f"'{_short(url)}' is not an absolute path nor a file://, data: or http(s):// URL")
    return _read_file(Path(url), policy)


def _file_url_path(url: str) -> Path:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise MediaError(f"'{_short(url)}' is not a valid URL") from None
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URLs must name a local file (file:///path), not host '{parts.netloc}'")
    return Path(urllib.parse.unquote(parts.path))


def _read_file(path: Path, policy: MediaPolicy) -> bytes:
    if "\x00" in str(path):  # the OS would refuse it with a ValueError, not an OSError
        raise MediaError("a file path cannot contain a NUL character")
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise MediaError(f"{path} is not a file")
        if size > policy.max_bytes:
            raise MediaError(f"{path} is {size} bytes, over the {_mib(policy.max_bytes)} limit")
        with open(path, "rb") as f:
            return f.read(policy.max_bytes + 1)[: policy.max_bytes]
    except FileNotFoundError:
        raise MediaError(f"no such file: {path}") from None
    except PermissionError:
        raise MediaError(f"the server may not read {path}") from None
    except OSError as e:
        raise MediaError(f"cannot read {path}: {e.strerror or e}") from None


def _read_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("a data: URL needs a comma before its payload (data:image/png;base64,...)")
    if not header.lower().endswith(";base64"):
        raise MediaError("only base64 data: URLs are supported (data:<mime>;base64,...)")
    if len(payload) * 3 // 4 > policy.max_bytes + 3:
        raise MediaError(f"the data: URL holds more than the {_mib(policy.max_bytes)} limit")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 payload is corrupt") from None


class _HTTPOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow at most 5 redirects, and only to http(s) URLs."""

    max_redirections = 5

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError(f"the server redirected to a non-http URL ({_short(newurl)}); not followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_HTTPOnlyRedirects)


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise MediaError("remote media fetches are turned off on this server (--no-remote-media); send a data: URL")
    request = urllib.request.Request(url, headers={"User-Agent": "mlx-server"})
    try:
        with _opener.open(request, timeout=policy.timeout) as response:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > policy.max_bytes:
                raise MediaError(f"{_short(url)} is {length} bytes, over the {_mib(policy.max_bytes)} limit")
            data = response.read(policy.max_bytes + 1)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:  # urllib refuses a redirect to file: and the like before asking us
            raise MediaError(f"{_short(url)} redirected to a non-http URL or too many times; not followed") from None
        raise MediaError(f"fetching {_short(url)} failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise MediaError(f"fetching {_short(url)} failed: {reason}") from None
    if len(data) > policy.max_bytes:
        raise MediaError(f"{_short(url)} is over the {_mib(policy.max_bytes)} limit")
    return data


def _decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_pixels(image, policy)
            image.load()
        return image.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError("not an image in a format the server can read (PNG, JPEG, WebP, GIF, BMP, TIFF...)") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"the image is corrupt or truncated ({e})") from None


def _check_pixels(image: Image.Image, policy: MediaPolicy) -> None:
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(f"the image is {width}x{height} pixels, over the {policy.max_pixels} pixel limit")
    if width < 1 or height < 1:
        raise MediaError("the image is empty")


def _animated_frames(data: bytes, policy: MediaPolicy) -> list[Image.Image] | None:
    """The frames of an animated GIF, WebP or PNG; None when the data is not an image Pillow reads."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        return None
    try:
        _check_pixels(image, policy)
        n = getattr(image, "n_frames", 1)
        frames = []
        for i in _spread(n, policy.max_video_frames):
            image.seek(i)
            frames.append(image.convert("RGB"))
        return frames
    except MediaError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise MediaError(f"the animation is corrupt ({e})") from None


def _container_frames(data: bytes, policy: MediaPolicy) -> list[Image.Image]:
    """Frames of a video file (MP4, WebM, MOV...) through PyAV's bundled FFmpeg."""
    try:
        import av
    except ImportError:
        raise MediaError("this server cannot decode video files (PyAV is not installed); send an animated GIF/WebP") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            if stream.width * stream.height > policy.max_pixels:
                raise MediaError(f"the video is {stream.width}x{stream.height} pixels, over the {policy.max_pixels} pixel limit")
            # Count by demuxing (no decoding) when the container does not say, then decode only what is kept.
            n = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        with av.open(io.BytesIO(data)) as container:
            wanted = set(_spread(n, policy.max_video_frames))
            frames = [f.to_image().convert("RGB") for i, f in enumerate(container.decode(video=0)) if i in wanted]
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"not a video the server can decode ({e})") from None
    return frames


def _spread(n: int, k: int) -> list[int]:
    """k indexes spread evenly over range(n) (all of them when n <= k)."""
    if n <= k:
        return list(range(n))
    return [round(i * (n - 1) / (k - 1)) for i in range(k)] if k > 1 else [0]


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[: limit - 3] + "..."


def _mib(n: int) -> str:
    """A byte count as people write a limit: 20 MiB, 512 KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"
