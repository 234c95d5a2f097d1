"""A tiny SmolVLM for tests: SmolLM2's real text weights and tokenizer, a small random vision tower.

SmolVLM-256M pairs a SigLIP vision tower with SmolLM2-135M (shared/MODELS.md). Here the text
side is the 2-layer SmolLM2 export the other tests use (real weights, real tokenizer); the
vision tower (2 layers, 32x32 tiles of 8x8 patches) and the connector are random, and the
tokenizer gets SmolVLM's image tokens with random embedding rows. A processor config makes
mlx-vlm's SmolVLM processor tile each image (longest edge 64: up to 2x2 tiles plus the whole
image, 4 tokens each), so the whole image path of mlx-vlm runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# SmolVLM's own chat template (content is always a list of parts).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
EXTRA_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
VISION = {
    "model_type": "smolvlm_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "image_size": 32,
    "patch_size": 8,
}
SCALE_FACTOR = 2
# SmolVLM-256M's own vision tower and tiling, for benchmarks (bench/vision_turns.py --real-vision):
# 512x512 tiles of 16x16 patches, 64 tokens per tile.
REAL_VISION = {**VISION, "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
               "num_hidden_layers": 12, "image_size": 512, "patch_size": 16}
REAL_SCALE_FACTOR = 4
PREPROCESSOR = {
    "image_processor_type": "SmolVLMImageProcessor",
    "processor_class": "SmolVLMProcessor",
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 0},  # a tile: the vision tower's image size
    "resample": 1,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 0},  # images are first resized to at most 2x2 tiles
}


def build_model(text_dir: Path, out: Path, vision: dict = VISION, scale_factor: int = SCALE_FACTOR) -> Path:
    """An mlx-vlm SmolVLM directory from the SmolLM2 export in `text_dir` (about 70 MB with 2 layers)."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from transformers import AutoTokenizer

    text_config = json.loads((text_dir / "config.json").read_text())
    text = mx.load(str(text_dir / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS})
    vocab = len(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")

    mx.random.seed(0)
    # The new tokens' rows, quantized as the real rows are (which are kept exactly): random
    # embeddings at the scale of the real ones; in the output head, copies of a token the model
    # never writes, so no new token wins a greedy step.
    quant = text_config["quantization"]["model.embed_tokens"]
    real = [text[f"model.embed_tokens.{part}"] for part in ("weight", "scales", "biases")]
    sample = mx.dequantize(*(r[:1024] for r in real), group_size=quant["group_size"], bits=quant["bits"])
    n_new = vocab - real[0].shape[0]
    new = mx.quantize(mx.random.normal((n_new, sample.shape[1])) * sample.std(), group_size=quant["group_size"], bits=quant["bits"])
    rare = real[0].shape[0] - 1
    embed = [mx.concatenate([r, x.astype(r.dtype)]) for r, x in zip(real, new)]
    head = [mx.concatenate([r, mx.repeat(r[rare:rare + 1], n_new, axis=0)]) for r in real]
    weights = {f"language_model.{k.removeprefix('model.')}": v for k, v in text.items()}
    for part, e, h in zip(("weight", "scales", "biases"), embed, head):
        weights[f"language_model.embed_tokens.{part}"] = e
        # SmolLM2 ties its output head to the embedding; mlx-vlm's Idefics3 text model wants its own.
        weights[f"language_model.lm_head.{part}"] = h
    embed_std = float(sample.std())

    from mlx_vlm.models.smolvlm import Model, ModelConfig, TextConfig, VisionConfig

    text_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                 "rope_theta", "num_hidden_layers", "max_position_embeddings", "head_dim")
    config = {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "image_token_id": image_token_id,
        "scale_factor": scale_factor,
        "vocab_size": vocab,
        "eos_token_id": [tokenizer.convert_tokens_to_ids("<end_of_utterance>"), tokenizer.eos_token_id],
        "text_config": {"model_type": "llama", "vocab_size": vocab, **{k: text_config[k] for k in text_keys}},
        "vision_config": vision,
        "quantization": {
            **{k: v for k, v in text_config["quantization"].items() if not isinstance(v, dict)},
            "language_model.embed_tokens": quant,
            "language_model.lm_head": quant,
        },
    }
    model = Model(ModelConfig(
        text_config=TextConfig(**config["text_config"]),
        vision_config=VisionConfig(**vision),
        model_type="smolvlm",
        scale_factor=scale_factor,
        vocab_size=vocab,
        image_token_id=image_token_id,
    ))
    tower = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")}
    # Scale the projection so image features are as large as text embeddings: the image matters.
    proj = "connector.modality_projection.proj.weight"
    tower[proj] = tower[proj] * (embed_std / float(mx.std(tower[proj])) / 4)
    weights.update(tower)
    # Vision and connector are not quantized: say so per module, as mlx-vlm reads it.
    for name in {k.rsplit(".", 1)[0] for k in tower}:
        if isinstance(_module(model, name), (nn.Linear, nn.Embedding)):
            config["quantization"][name] = False

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(partial)
    (partial / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tile = vision["image_size"]
    preprocessor = {**PREPROCESSOR, "max_image_size": {"longest_edge": tile}, "size": {"longest_edge": 2 * tile}}
    (partial / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    image_seq_len = (tile // vision["patch_size"]) ** 2 // scale_factor**2
    (partial / "processor_config.json").write_text(
        json.dumps({"processor_class": "SmolVLMProcessor", "image_seq_len": image_seq_len}, indent=2)
    )
    partial.rename(out)
    return out


def _module(model, dotted: str):
    for part in dotted.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def version() -> str:
    """Changes with this file, so a cached model built by an older one is not reused."""
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
