"""engine/fuse.py: a model with fused q/k/v and gate/up projections computes what the unfused one
computes (same greedy tokens, logits allclose), float and quantized; what cannot be fused is left alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2, qwen3

from mlx_server.engine.batch import PadAwareBatchGenerator
from mlx_server.engine.fuse import fuse_projections, should_fuse
from mlx_server.engine.loader import load_model
from mlx_server.engine.memory import kv_bytes_per_token
from mlx_server.engine.sampling import greedy

VOCAB = 97
SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=False)
FAMILIES = {
    "llama": lambda: llama.Model(llama.ModelArgs(model_type="llama", **SHAPE)),
    "llama-with-biases": lambda: llama.Model(
        llama.ModelArgs(model_type="llama", attention_bias=True, mlp_bias=True, **SHAPE)
    ),
    "qwen2": lambda: qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **SHAPE)),  # q/k/v biases
    "qwen3": lambda: qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=32, max_position_embeddings=4096,
                                                 rope_theta=1e6, **SHAPE)),  # q/k norms
}


def random_model(family: str, seed: int = 3):
    """The same random weights for the same seed; larger than the default init so that greedy
    tokens vary and ties are unlikely."""
    mx.random.seed(seed)
    model = FAMILIES[family]()
    # Vectors (norm weights, biases) get noise, so that the biases are not zero.
    spread = tree_map(lambda p: p * 4.0 if p.ndim > 1 else p + 0.1 * mx.random.normal(p.shape), model.parameters())
    model.update(spread)
    mx.eval(model.parameters())
    return model


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % (VOCAB - 1) + 1 for i in range(n)]


def greedy_tokens(model, tokens: list[int], n: int = 16) -> list[int]:
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(tokens), model, max_tokens=n), range(n))]


def logits(model, tokens: list[int]) -> mx.array:
    return model(mx.array(tokens)[None])


def assert_same_model(plain, fused, tokens: list[int], n: int = 16, atol: float = 1e-4):
    """Greedy decoding (prefill, then the KV cache) gives the same tokens; a forward pass without
    a cache gives the same logits."""
    assert greedy_tokens(fused, tokens, n) == greedy_tokens(plain, tokens, n)
    assert mx.allclose(logits(fused, tokens), logits(plain, tokens), atol=atol, rtol=1e-4).item()


def is_fused(layer) -> tuple[bool, bool]:
    return "qkv_proj" in layer.self_attn, "gate_up_proj" in layer.mlp


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_float_model_decodes_the_same_tokens(family):
    plain, fused = random_model(family), random_model(family)
    assert fuse_projections(fused) == 2
    assert all(is_fused(layer) == (True, True) for layer in fused.layers)
    assert "q_proj" not in fused.layers[0].self_attn and "up_proj" not in fused.layers[0].mlp
    assert_same_model(plain, fused, prompt(23))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_quantized_model_decodes_the_same_tokens(family):
    plain, fused = random_model(family), random_model(family)
    for m in (plain, fused):
        nn.quantize(m, group_size=32, bits=4)
    assert fuse_projections(fused) == 2
    assert isinstance(fused.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    assert isinstance(fused.layers[0].mlp.gate_up_proj, nn.QuantizedLinear)
    assert_same_model(plain, fused, prompt(23))


@pytest.mark.parametrize(
    "predicate",
    [
        lambda path, m: {"group_size": 32, "bits": 8} if path.endswith("k_proj") else True,  # bits differ
        lambda path, m: {"group_size": 64, "bits": 4} if path.endswith("v_proj") else True,  # group size differs
        lambda path, m: path.endswith("q_proj"),  # one quantized, two float
    ],
    ids=["bits", "group-size", "kind"],
)
def test_layer_with_mismatched_quantization_is_left_unfused(predicate):
    plain, fused = random_model("llama"), random_model("llama")
    for m in (plain, fused):
        nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and predicate(p, m))
    assert fuse_projections(fused) == 2  # the MLPs still fuse
    for layer in fused.layers:
        assert is_fused(layer) == (False, True)
        assert {"q_proj", "k_proj", "v_proj"} <= set(layer.self_attn)
    assert_same_model(plain, fused, prompt(23))


def test_fusing_twice_changes_nothing():
    plain, fused = random_model("qwen3"), random_model("qwen3")
    assert fuse_projections(fused) == 2
    assert fuse_projections(fused) == 0
    assert all(is_fused(layer) == (True, True) for layer in fused.layers)
    assert_same_model(plain, fused, prompt(23))


def test_kv_bytes_per_token_is_unchanged_by_fusing():
    plain, fused = random_model("qwen3"), random_model("qwen3")
    fuse_projections(fused)
    assert kv_bytes_per_token(fused) == kv_bytes_per_token(plain) > 0


def ragged_batch_tokens(model, max_tokens=(12, 12, 12)) -> list[list[int]]:
    """Three prompts of different lengths through the server's batch generator, greedy: each one's tokens."""
    gen = PadAwareBatchGenerator(model, stop_tokens=[])
    uids = gen.insert([prompt(17, 1), prompt(5, 2), prompt(11, 3)], max_tokens=list(max_tokens), samplers=[greedy] * 3)
    out = {uid: [] for uid in uids}
    for _ in range(16):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    return list(out.values())


def test_ragged_batch_decodes_the_same_tokens_fused():
    """The server's batch path: left-padded rows, an attention mask and per-row positions."""
    fused = random_model("llama")
    fuse_projections(fused)
    assert ragged_batch_tokens(fused) == ragged_batch_tokens(random_model("llama"))


class NotLlamaFamily(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4)]


def test_other_model_types_are_left_alone():
    assert fuse_projections(NotLlamaFamily()) == 0


def test_tensor_parallel_never_fuses_and_auto_means_gpus():
    assert not should_fuse("on", "tensor")
    assert should_fuse("on", "pipeline") and should_fuse("on", None)
    assert not should_fuse("off", None) and not should_fuse("off", "pipeline")
    assert should_fuse("auto", None, "gpu") and should_fuse("auto", "pipeline", "gpu")
    assert not should_fuse("auto", None, "cpu") and not should_fuse("auto", "tensor", "gpu")


@pytest.mark.parametrize("dequantize", ["on", "off"], ids=["float32", "4-bit"])
def test_smollm2_decodes_the_same_tokens_fused(tiny_model_dir, dequantize):
    plain = load_model(tiny_model_dir, dequantize=dequantize, fuse="off")
    fused = load_model(tiny_model_dir, dequantize=dequantize, fuse="on")
    assert all(is_fused(layer) == (True, True) for layer in fused.model.layers)
    assert not any(any(is_fused(layer)) for layer in plain.model.layers)
    p = plain.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert_same_model(plain.model, fused.model, p, n=24, atol=1e-3)


def test_tiny_qwen3_decodes_the_same_tokens_fused(qwen3_model_dir):
    """The wired test model (its layers add nothing: tests/tiny_qwen3.py) through the loader;
    the random qwen3 above is the one whose layers matter."""
    plain = load_model(qwen3_model_dir, fuse="off")
    fused = load_model(qwen3_model_dir, fuse="on")
    assert all(is_fused(layer) == (True, True) for layer in fused.model.layers)
    p = plain.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert_same_model(plain.model, fused.model, p, n=8)
