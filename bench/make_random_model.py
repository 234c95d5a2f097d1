"""Write an MLX model directory of a real shape with random weights (GPU benchmarks: real speed, no hub).

    python bench/make_random_model.py --shape llama3-8b --bits 4 --tokenizer-from DIR --out OUT

The tokenizer files are copied from an existing model directory (e.g. the SmolLM2 export); token ids
beyond its vocabulary are fine for speed measurements.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

SHAPES = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=49152, rope_theta=500000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       tie_word_embeddings=True),
}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bits", type=int, default=0, help="quantize to this many bits (0: keep --dtype)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tokenizer-from", required=True, help="a model directory whose tokenizer files are copied")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    config = dict(SHAPES[args.shape])
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    if args.bits:
        model, config = quantize_model(model, config, args.group_size, args.bits)
    out = Path(args.out)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer_from) / name
        if src.exists():
            shutil.copy(src, out / name)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
