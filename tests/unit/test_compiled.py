"""engine/compiled.py: compiled decode steps compute what mlx-lm's forward pass computes (same
greedy tokens, same logits), alone and with fused projections, float and quantized, in the server's
padded batches; prefill chunks and other models take mlx-lm's path unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, rope_utils
from mlx_lm.models.cache import make_prompt_cache

from mlx_server.engine.compiled import compile_decode, should_compile
from mlx_server.engine.fuse import fuse_projections
from mlx_server.engine.loader import load_model
from unit.test_fuse import (FAMILIES, SHAPE, NotLlamaFamily, assert_same_model, prompt, ragged_batch_tokens,
                            random_model)


def compiled(family: str, fused: bool = False, quantized: bool = False):
    model = random_model(family)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    if fused:
        fuse_projections(model)
    assert compile_decode(model) == len(model.layers)
    return model


def plain(family: str, quantized: bool = False):
    model = random_model(family)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    return model


def decode_logits(model, tokens: list[int], steps: int = 6) -> list[mx.array]:
    """Each decode step's logits after a prefill, feeding the prompt's own tokens back one at a time."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    out = []
    for t in tokens[:steps]:
        out.append(model(mx.array([[t]]), cache=cache))
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_compiled_decode_gives_the_same_tokens_and_logits(family, fused):
    reference, model = plain(family), compiled(family, fused)
    assert type(model.layers[0]).__name__.startswith("CompiledDecode")
    assert_same_model(reference, model, prompt(23), n=20)
    for got, want in zip(decode_logits(model, prompt(19)), decode_logits(reference, prompt(19))):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_quantized_decode_gives_the_same_tokens(family):
    assert_same_model(plain(family, quantized=True), compiled(family, fused=True, quantized=True), prompt(23), n=20)


def test_compiled_steps_run_only_for_decode():
    """A prefill chunk (several tokens) takes mlx-lm's path; a decode step the compiled one."""
    model = compiled("llama")
    calls = []
    layer = model.layers[0]
    real = layer._decode_pre
    layer._decode_pre = lambda *a: calls.append(a[0].shape) or real(*a)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt(9)]), cache=cache))
    assert calls == []
    mx.eval(model(mx.array([[3]]), cache=cache))
    assert calls == [(1, 1, SHAPE["hidden_size"])]


def test_ragged_batch_decodes_the_same_tokens_compiled():
    """The server's batch path: left-padded rows, an attention mask and per-row positions (an array
    offset into the compiled RoPE), then rows finishing and the batch shrinking (a new trace)."""

    want = ragged_batch_tokens(plain("llama"), max_tokens=(12, 4, 8))
    assert [len(t) for t in want] == [12, 4, 8]
    assert ragged_batch_tokens(compiled("llama", fused=True), max_tokens=(12, 4, 8)) == want


def test_other_blocks_and_ropes_are_left_alone():
    assert compile_decode(NotLlamaFamily()) == 0
    model = random_model("llama")
    model.layers[1].self_attn.rope = rope_utils.DynamicNTKScalingRoPE(16, 4096, False, 10000.0, 2.0)  # its offset is Python arithmetic
    assert compile_decode(model) == 1
    assert type(model.layers[1]) is llama.TransformerBlock


def test_auto_means_gpus_and_tensor_parallel_never_compiles():
    assert should_compile("auto", None, "gpu") and should_compile("auto", "pipeline", "gpu")
    assert not should_compile("auto", None, "cpu") and not should_compile("off", None, "gpu")
    assert should_compile("on", None, "cpu")
    assert not should_compile("on", "tensor", "gpu") and not should_compile("auto", "tensor", "gpu")


@pytest.mark.parametrize("dequantize", ["on", "off"], ids=["float32", "4-bit"])
def test_smollm2_through_the_loader_decodes_the_same_tokens_compiled(tiny_model_dir, dequantize):
    reference = load_model(tiny_model_dir, dequantize=dequantize, fuse="off", compile_decode="off")
    model = load_model(tiny_model_dir, dequantize=dequantize, fuse="on", compile_decode="on")
    assert all(type(layer).__name__.startswith("CompiledDecode") for layer in model.model.layers)
    assert not any(type(layer).__name__.startswith("CompiledDecode") for layer in reference.model.layers)
    p = reference.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert_same_model(reference.model, model.model, p, n=24, atol=1e-3)
