"""Images and videos in chat messages, for vision models: template parts in, prompt tokens out.

`ChatServing.template_message` turns a message's media (`image_url` / `video_url` parts, Jan's
`images` / `videos` arrays) into `{"type": "image" | "video", "url", "param"}` template parts;
`load_media` then loads each one (media.py), turning a video into its sampled frames, each an
image part, so that every image model can take video. The processor (engine/vision.py) places
the image tokens where the chat template rendered the parts. Every failure is a 400 naming the part.
"""

from __future__ import annotations

from mlx_server.api.errors import APIError
from mlx_server.api.openai.protocol import ImageURLPart, VideoURLPart
from mlx_server.media import LoadedImage, MediaError, MediaPolicy, load_image, load_video

MAX_IMAGES = 64  # per request, video frames included: each becomes hundreds of prompt tokens


def media_part(part, param: str) -> dict | None:
    """An OpenAI content part as a template part, if it is an image or a video."""
    if isinstance(part, ImageURLPart):
        return {"type": "image", "url": part.image_url.url, "param": param}
    if isinstance(part, VideoURLPart):
        return {"type": "video", "url": part.video_url.url, "param": param}
    return None


def array_parts(message, i: int) -> list[dict]:
    """Jan's `images` and `videos` arrays beside the content, as template parts (they go first)."""
    parts = []
    for field, kind in (("images", "image"), ("videos", "video")):
        for k, url in enumerate(getattr(message, field) or []):
            parts.append({"type": kind, "url": url, "param": f"messages[{i}].{field}[{k}]"})
    return parts


def template_content(parts: list[dict], text: str, interleaved: bool) -> list[dict]:
    """A vision model's message content: always a list of parts (its templates index into it).

    `parts` holds the media and, when `interleaved`, the text parts in their order; otherwise
    `text` (the message's whole text, tool calls included) follows the media."""
    if interleaved and any(p["type"] == "text" for p in parts):
        return parts
    media = [p for p in parts if p["type"] != "text"]
    return media + [{"type": "text", "text": text}] if text or not media else media


def load_media(messages: list[dict], policy: MediaPolicy) -> list[LoadedImage]:
    """Load every image and video part of the template messages, in order; a video part is
    replaced by one image part per sampled frame. Raises APIError(400) naming the part at fault."""
    images: list[LoadedImage] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        expanded = []
        for part in content:
            if part.get("type") not in ("image", "video"):
                expanded.append(part)
                continue
            param = part.get("param", "messages")
            try:
                if part["type"] == "image":
                    loaded = [load_image(part["url"], policy)]
                else:
                    loaded = load_video(part["url"], policy)
            except MediaError as e:
                raise APIError(400, f"{param}: cannot use this {part['type']}: {e}", param=param, code="invalid_media")
            images += loaded
            if len(images) > MAX_IMAGES:
                raise APIError(400, f"{param}: at most {MAX_IMAGES} images (video frames included) per request", param=param)
            expanded += [{"type": "image", "param": param} for _ in loaded]
        message["content"] = expanded
    return images
