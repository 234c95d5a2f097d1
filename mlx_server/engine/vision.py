"""Vision-language models: loaded with mlx-vlm, served through the same batch as text.

An image request takes three steps, and the engine thread stays the one owner of the model:
  1. on the request's thread, `Vision.prepare` runs the model's processor over the rendered
     prompt and the decoded images: the prompt tokens (image placeholders expanded) and the
     pixel arrays, plus a cache key in which each image token stands for the images' hash;
  2. on the engine thread, `Vision.prefill` fills a KV cache with the prompt up to its last
     token from the model's multimodal input embeddings (image features are reused by hash),
     starting after whatever prefix the prompt cache already holds under that key;
  3. the last prompt token and the whole decode then run in mlx-lm's BatchGenerator beside
     every other sequence: past the prompt, a VLM's language model is a text model.

This holds for models whose language model places tokens by KV-cache offset alone and keeps
a plain KV cache (Idefics3/SmolVLM, LLaVA, ...). Others (multimodal RoPE as in Qwen-VL,
sliding-window caches) are refused by `unsupported_reason`; the loader then serves their
text part through mlx-lm, without images.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from mlx_server.log import logger
from mlx_server.media import LoadedImage


def is_vision_config(config: dict) -> bool:
    """A model directory whose config describes a vision tower (SmolVLM, LLaVA, Qwen-VL...)."""
    return isinstance(config.get("vision_config"), dict)


@dataclass
class VisionInput:
    """A prompt with images, as the processor made it; built off the engine thread, read on it."""

    tokens: list[int]
    arrays: dict[str, np.ndarray]  # pixel values and the like, as the model's embedding step takes them
    positions: list[int]  # the image tokens' indexes in `tokens`: where image features go
    images_key: str  # hash of the images' contents, in order
    cache_key: list[int] = field(default_factory=list)  # `tokens`, image tokens replaced by an id of images_key


class TextDecoder(nn.Module):
    """A VLM seen as an mlx-lm text model (token ids in, logits out), which BatchGenerator drives.

    Holds the whole VLM, so parameters, dequantization and memory planning cover the vision
    tower too."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        self.vlm = vlm
        self.args = vlm.config.text_config  # memory planning reads the attention shape here

    @property
    def layers(self):
        return self.vlm.language_model.layers

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self.vlm.language_model(inputs, cache=cache).logits


class Vision:
    """What a served VLM adds to the engine: preparing image prompts and prefilling them."""

    def __init__(self, vlm: nn.Module, processor, feature_cache_size: int = 16):
        self.vlm = vlm
        self.processor = processor
        self.model_type = vlm.config.model_type
        config = vlm.config
        self.image_token_id = getattr(config, "image_token_index", None) or getattr(config, "image_token_id")
        # Image features as placed in the prompt's embeddings, by images_key; engine thread only.
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self._feature_cache_size = feature_cache_size

    # ---- any thread ----

    def prepare(self, prompt: str, images: list[LoadedImage]) -> VisionInput:
        """The processor's tokens and pixel arrays for a rendered prompt with one placeholder per image.

        Raises ValueError (a client error) when the prompt and images do not fit together."""
        from mlx_vlm.utils import prepare_inputs

        inputs = prepare_inputs(
            self.processor, images=[i.image for i in images], prompts=[prompt],
            image_token_index=self.image_token_id, add_special_tokens=False,
        )
        tokens = np.array(inputs.pop("input_ids")).reshape(-1).tolist()
        inputs.pop("attention_mask", None)
        positions = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        if not positions:
            raise ValueError("the chat template put no image into the prompt")
        images_key = hashlib.sha256(json.dumps([i.digest for i in images]).encode()).hexdigest()
        stand_in = -1 - int(images_key[:15], 16)  # never a real token id
        cache_key = list(tokens)
        for p in positions:
            cache_key[p] = stand_in
        arrays = {k: np.array(v) for k, v in inputs.items() if v is not None and not isinstance(v, (str, list))}
        return VisionInput(tokens, arrays, positions, images_key, cache_key)

    # ---- the engine thread ----

    def prefill(self, vin: VisionInput, cache: list | None, start: int, step: int = 2048) -> list:
        """Run the prompt's tokens [start, last) into `cache` (a new one if None) from multimodal embeddings."""
        if cache is None:
            cache = [KVCache() for _ in self.vlm.language_model.layers]
        ids = mx.array(vin.tokens)[None]
        embeds = self._embeddings(vin, ids)
        end = len(vin.tokens) - 1
        language_model = self.vlm.language_model
        for a in range(start, end, step):
            b = min(a + step, end)
            language_model(inputs=ids[:, a:b], inputs_embeds=embeds[:, a:b], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    def _embeddings(self, vin: VisionInput, ids: mx.array) -> mx.array:
        """The prompt's input embeddings, image features in place; features come from the cache when they can."""
        positions = mx.array(vin.positions)
        features = self._features.get(vin.images_key)
        if features is not None:
            self._features.move_to_end(vin.images_key)
            embeds = self.vlm.get_input_embeddings(ids, None).inputs_embeds
            embeds[:, positions] = features[None].astype(embeds.dtype)
            return embeds
        arrays = {k: mx.array(v) for k, v in vin.arrays.items()}
        out = self.vlm.get_input_embeddings(ids, arrays.pop("pixel_values", None), **arrays)
        extra = [k for k, v in out.to_dict().items() if k != "inputs_embeds" and v is not None]
        if extra:  # the decode would need these too, and BatchGenerator cannot pass them
            raise RuntimeError(f"{self.model_type}'s image embeddings come with {extra}; images are not supported")
        embeds = out.inputs_embeds
        features = embeds[0, positions]
        mx.eval(embeds, features)
        logger.info("vision: encoded the images of a prompt into %d image tokens", len(vin.positions))
        self._features[vin.images_key] = features
        while len(self._features) > self._feature_cache_size:
            self._features.popitem(last=False)
        return embeds


CROSS_ATTENTION_TYPES = {"mllama"}


def unsupported_reason(config: dict) -> str | None:
    """Why this VLM cannot take images through the batch (see the module docstring); None if it can."""
    from mlx_vlm.utils import get_model_and_args

    text = config.get("text_config") or {}
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    if "mrope_section" in rope or "mrope_section" in text:
        return "it places image tokens with multimodal rotary positions (mRoPE)"
    if config.get("model_type") in CROSS_ATTENTION_TYPES:
        return "it attends to images by cross-attention, not through image tokens"
    try:
        arch, model_type = get_model_and_args(config)
    except (KeyError, ValueError, ImportError):
        return f"mlx-vlm does not know its model type '{config.get('model_type')}'"
    language_model = getattr(arch, "LanguageModel", None)
    if language_model is None or not hasattr(arch.Model, "get_input_embeddings"):
        return "mlx-vlm gives it no separate language model and input embeddings"
    if hasattr(language_model, "make_cache"):
        return "its language model keeps a KV cache of its own kind (sliding windows or state)"
    if not any(k in config for k in ("image_token_index", "image_token_id")):
        return "its config names no image token"
    return None


def load_vision_model(path: Path) -> tuple[TextDecoder, object, Vision]:
    """The text decoder BatchGenerator drives, the mlx-lm tokenizer, and the Vision helper of a VLM."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load as load_vlm

    vlm, processor = load_vlm(str(path))
    eos = getattr(vlm.config, "eos_token_id", None) or getattr(vlm.config.text_config, "eos_token_id", None)
    tokenizer = load_tokenizer(path, eos_token_ids=eos)
    # A VLM's chat template often lives with its processor (chat_template.json), not its tokenizer.
    template = getattr(processor, "chat_template", None)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
        tokenizer.has_chat_template = True
    return TextDecoder(vlm), tokenizer, Vision(vlm, processor)
