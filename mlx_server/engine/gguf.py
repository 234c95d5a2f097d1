"""Load llama-architecture GGUF files straight into mlx-lm, and export them as MLX model directories."""

from __future__ import annotations

import json

from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import save_config
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


class GGUFError(ValueError):
    """The GGUF file uses an architecture, tensor or tokenizer this module does not support."""


_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's `tokenizer.ggml.pre` names for the byte-level BPE pre-tokenizers we can rebuild.
_PRE_TOKENIZERS = {
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],
    "gpt2": [],
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks, which mx.load keeps as affine quantization groups


def _read(path: str | Path) -> tuple[dict, dict]:
    """Read all tensors and metadata, refusing anything but a complete llama model."""
    try:
        weights, meta = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"unsupported GGUF architecture {arch!r} in {path}: only 'llama' is supported")
    # mx.load silently drops tensors of types it cannot read, so check that none is missing.
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{name}.weight" for i in range(_num(meta, "llama.block_count")) for name in _BLOCK_NAMES
    ]
    if missing := [name for name in required if name not in weights]:
        raise GGUFError(
            f"GGUF tensors missing or of a type MLX cannot read in {path}: {', '.join(missing[:5])}"
        )
    return weights, meta


def _num(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _config(meta: dict) -> dict:
    """The Hugging Face style llama config described by the GGUF metadata."""
    hidden = _num(meta, "llama.embedding_length")
    heads = _num(meta, "llama.attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _num(meta, "llama.block_count"),
        "intermediate_size": _num(meta, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _num(meta, "llama.attention.head_count_kv", heads),
        "head_dim": _num(meta, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _num(meta, "llama.attention.layer_norm_rms_epsilon"),
        "vocab_size": _num(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "max_position_embeddings": _num(meta, "llama.context_length"),
        "rope_theta": _num(meta, "llama.rope.freq_base", 10000.0),
        "rope_traditional": False,
        "bos_token_id": _num(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _num(meta, "tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _num(meta, "llama.rope.scaling.factor")}
    elif scaling != "none":
        raise GGUFError(f"unsupported RoPE scaling {scaling!r}")
    return config


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's reordering of Q/K rows for interleaved RoPE (exact: quantization is per row).

    llama.cpp's convert views the rows as (n_head, 2, head_dim // 2) and swaps axes 1 and 2."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(weights: dict, config: dict) -> dict:
    """Rename GGUF tensors to the mlx-lm llama layout, with standard (non-interleaved) Q/K rows."""
    out = {}
    for name, w in weights.items():
        base, _, kind = name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
            new = f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
            if parts[2] == "attn_q":
                w = _unpermute(w, config["num_attention_heads"])
            elif parts[2] == "attn_k":
                w = _unpermute(w, config["num_key_value_heads"])
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        else:
            raise GGUFError(f"unsupported GGUF tensor {name!r}")
        out[f"{new}.{kind}"] = w
    return out


def _quantization(weights: dict) -> dict | None:
    """mlx-lm's quantization config: the commonest bits, with per-layer entries where bits differ."""
    per_layer = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            layer = name[: -len(".scales")]
            in_features = scales.shape[1] * _GROUP_SIZE
            per_layer[layer] = weights[f"{layer}.weight"].shape[1] * 32 // in_features
    if not per_layer:
        return None
    bits = Counter(per_layer.values()).most_common(1)[0][0]
    quant = {"group_size": _GROUP_SIZE, "bits": bits, "mode": "affine"}
    quant.update({p: {"group_size": _GROUP_SIZE, "bits": b} for p, b in per_layer.items() if b != bits})
    return quant


def _build_model(config: dict, weights: dict) -> nn.Module:
    """An mlx-lm llama model holding the weights, quantized per layer as mlx_lm.utils.load_model does."""
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if quant := config.get("quantization"):
        nn.quantize(
            model,
            group_size=_GROUP_SIZE,
            bits=quant["bits"],
            class_predicate=lambda p, m: quant.get(p, True) if f"{p}.scales" in weights else False,
        )
    model.load_weights(list(weights.items()))
    model.eval()
    return model


def _tokenizer(meta: dict) -> PreTrainedTokenizerFast:
    """Rebuild the Hugging Face byte-level BPE tokenizer from the GGUF vocabulary and merges."""
    model_name, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt2")
    if model_name != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"unsupported GGUF tokenizer {model_name!r} with pre-tokenizer {pre!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        _PRE_TOKENIZERS[pre] + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()

    def of_type(kind):
        return [t for t, k in zip(tokens, types) if k == kind]

    tok.add_tokens([AddedToken(t, normalized=False) for t in of_type(_USER_DEFINED)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in of_type(_CONTROL)])

    def token(key):
        i = _num(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        add_bos_token=bool(_num(meta, "tokenizer.ggml.add_bos_token", False)),
        bos_token=token("bos"),
        eos_token=token("eos"),
        pad_token=token("padding"),
        unk_token=token("unknown"),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _load(path: str | Path) -> tuple[dict, dict, PreTrainedTokenizerFast]:
    """The HF config, mlx-lm weights and HF tokenizer of a GGUF file."""
    weights, meta = _read(path)
    config = _config(meta)
    weights = _hf_weights(weights, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quant := _quantization(weights):
        config["quantization"] = quant
    return config, weights, _tokenizer(meta)


def load_gguf(path: str | Path) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Build an mlx-lm llama model and tokenizer from a GGUF file, without writing anything to disk.

    Returns (model, tokenizer, config); config is the HF-style config dict. Raises GGUFError."""
    config, weights, tokenizer = _load(path)
    model = _build_model(config, weights)
    # As mlx_lm.tokenizer_utils.load does for a ByteLevel decoder and a config eos_token_id.
    wrapper = TokenizerWrapper(tokenizer, BPEStreamingDetokenizer, eos_token_ids=[config["eos_token_id"]])
    return model, wrapper, config


def export_mlx_dir(gguf_path: str | Path, out_dir: str | Path, num_layers: int | None = None, shards: int = 1) -> Path:
    """Write a model directory that `mlx_lm.load` loads to the GGUF's model.

    num_layers keeps only the first N transformer layers (a small copy for protocol tests);
    shards > 1 splits the weights into that many files by layer, with the usual index file."""
    config, weights, tokenizer = _load(gguf_path)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        weights = {
            k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
        }
        if quant := config.get("quantization"):
            config["quantization"] = {
                k: v for k, v in quant.items() if not isinstance(v, dict) or f"{k}.scales" in weights
            }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    else:
        _save_sharded(weights, out, shards, config["num_hidden_layers"])
    save_config(config, out / "config.json")
    # The chat template goes in tokenizer_config.json, where every loader looks for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return out


def _save_sharded(weights: dict, out: Path, shards: int, n_layers: int) -> None:
    """Hugging Face's layout: model-0000i-of-0000n.safetensors, a run of layers each (the embeddings
    and the final norm in the first), and model.safetensors.index.json mapping every weight to its file."""
    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            return min(int(name.split(".")[2]) * shards // n_layers, shards - 1)
        return 0

    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = {k: v for k, v in weights.items() if shard_of(k) == i}
        mx.save_safetensors(str(out / file), part, metadata={"format": "mlx"})
        weight_map.update({k: file for k in part})
    total = sum(v.nbytes for v in weights.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
