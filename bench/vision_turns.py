"""Turn 1 vs turn 2 of a chat about one image: how long each prompt takes to prefill.

Turn 1 encodes the image and prefills the whole prompt; turn 2 (the same image, the answer,
a follow-up question) should find the image's KV prefix in the prompt cache and prefill only
the new text. Reports the server's own `timings` (prompt_ms, prompt_n, cache_n) for both.

    .venv/bin/python bench/vision_turns.py                 # the tiny test SmolVLM, 3 rounds
    .venv/bin/python bench/vision_turns.py --real-vision   # with SmolVLM-256M's vision tower (random weights)
    .venv/bin/python bench/vision_turns.py --model DIR     # any vision model directory
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import CACHE, ServerProcess  # noqa: E402


def tiny_vlm(real_vision: bool) -> Path:
    import tiny_smolvlm
    from mlx_server.engine.gguf import export_mlx_dir
    from mlx_server.engine.loader import default_model_path

    text = CACHE / "models" / "smollm2-135m-2layers"
    if not (text / "config.json").exists():
        export_mlx_dir(default_model_path(), text, num_layers=2)
    if real_vision:
        out = CACHE / "models" / f"smolvlm-256m-vision-{tiny_smolvlm.version()}"
        return tiny_smolvlm.build_model(text, out, tiny_smolvlm.REAL_VISION, tiny_smolvlm.REAL_SCALE_FACTOR)
    return tiny_smolvlm.build_model(text, CACHE / "models" / f"smolvlm-tiny-{tiny_smolvlm.version()}")


def image_url(seed: int, size: tuple[int, int]) -> str:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def turn(client: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a vision model directory (default: the tiny test SmolVLM)")
    p.add_argument("--real-vision", action="store_true", help="the tiny model with SmolVLM-256M's vision tower and tiling (random weights, 320 image tokens)")
    p.add_argument("--rounds", type=int, default=3, help="chats, each about a new image (default 3)")
    p.add_argument("--size", default="512x384", help="image size WxH (default 512x384)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    model = args.model or str(tiny_vlm(args.real_vision))
    server = ServerProcess("--model", model, "--ctx-size", "8192")
    rows = []
    try:
        server.wait_ready(300)
        with httpx.Client(base_url=server.url, timeout=600) as client:
            turn(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(999, size)}},
                                                       {"type": "text", "text": "Warm up."}]}], 2)
            for seed in range(args.rounds):
                image = {"type": "image_url", "image_url": {"url": image_url(seed, size)}}
                messages = [{"role": "user", "content": [image, {"type": "text", "text": "Describe this picture."}]}]
                first = turn(client, messages, args.max_tokens)
                messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "What colours are in it?"}]
                second = turn(client, messages, args.max_tokens)
                rows.append((first["timings"], second["timings"]))
    finally:
        server.stop()
    print(f"model: {model}   image: {args.size}")
    print(f"{'round':>5} | {'turn 1 prompt_ms':>16} {'prefilled':>9} {'cached':>6} | {'turn 2 prompt_ms':>16} {'prefilled':>9} {'cached':>6}")
    for i, (a, b) in enumerate(rows):
        print(f"{i:>5} | {a['prompt_ms']:>16.1f} {a['prompt_n']:>9} {a['cache_n']:>6} | {b['prompt_ms']:>16.1f} {b['prompt_n']:>9} {b['cache_n']:>6}")
    t1 = statistics.median(a["prompt_ms"] for a, _ in rows)
    t2 = statistics.median(b["prompt_ms"] for _, b in rows)
    print(f"median prompt_ms: turn 1 {t1:.1f}, turn 2 {t2:.1f} ({t1 / t2:.1f}x faster)" if t2 else "")


if __name__ == "__main__":
    main()
