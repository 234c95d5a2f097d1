"""Compiled decode steps: each layer's work around the attention in two `mx.compile`d functions.

A decode step of a 32-layer model builds several hundred ops in Python, one module call at a time,
and on a GPU the host's share of a step (building the graph, then MLX encoding it) is as long as the
GPU's. For a decode step (one new token per sequence) every shape in a layer is fixed except the KV
cache's length, so the layer is cut in three:

- before the cache (compiled): input norm, q/k/v projections, q/k norms (qwen3), RoPE at the
  cache's offset, passed as an array so one trace serves every position;
- the cache update and the attention, as mlx-lm does them (their shapes grow every step);
- after the attention (compiled): output projection, residual, post-attention norm, MLP, residual.

A compiled function is traced once per batch size and then replayed from C++, so the Python work of
a layer is two calls instead of a dozen module calls; MLX also fuses the elementwise ops it can.
With fused projections, an H200 decoded 8 sequences 1.24-1.30x and one Qwen3-0.6B sequence 1.22x
faster (README, Performance); on CPUs, where a step is bound by its matmuls, it is off by default.
The ops are mlx-lm's own, in the same order and dtypes, so the tokens are the same (tests check).
Prefill chunks (more than one token) take mlx-lm's forward pass unchanged.

Applies to mlx-lm's llama-family blocks (llama and mistral, qwen2, qwen3), fused or not
(engine/fuse.py), whose RoPE passes its offset straight to `mx.fast.rope`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3, rope_utils
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_server.engine import fuse

_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock, qwen3.TransformerBlock)
# RoPE modules whose offset goes straight to mx.fast.rope (an array offset works); DynamicNTK's
# does arithmetic on it in Python and is left out.
_ROPES = (nn.RoPE, rope_utils.Llama3RoPE, rope_utils.SuScaledRoPE, rope_utils.YarnRoPE)


def should_compile(mode: str, parallel: str | None, device: str) -> bool:
    """`auto`: on GPUs. Never with `--parallel tensor`: its projections end in collectives."""
    return fuse.on_gpus_by_default("--compile-decode", mode, parallel, device, "its projections end in collectives")


def compile_decode(model) -> int:
    """Give every llama-family block of an mlx-lm model a compiled decode step; returns how many
    blocks got one. Blocks of other kinds, or with another RoPE, are left as they are."""
    done = 0
    for layer in getattr(model, "layers", None) or []:
        if not _compilable(layer):
            continue
        layer._decode_pre = mx.compile(functools.partial(_pre, layer))
        layer._decode_post = mx.compile(functools.partial(_post, layer))
        layer.__class__ = _compiled_class(type(layer))
        done += 1
    return done


def _compilable(layer) -> bool:
    if type(layer) not in _BLOCKS:
        return False
    attn = getattr(layer, "self_attn", None)  # mlx-lm's, or fuse.py's subclass of it
    return isinstance(attn, fuse.ATTENTION) and type(getattr(attn, "rope", None)) in _ROPES


_COMPILED: dict[type, type] = {}


def _compiled_class(cls: type) -> type:
    if cls not in _COMPILED:
        _COMPILED[cls] = type(f"CompiledDecode{cls.__name__}", (cls,), {"__call__": _block_call})
    return _COMPILED[cls]


def _block_call(self, x: mx.array, mask=None, cache=None) -> mx.array:
    if x.shape[1] != 1 or cache is None:
        return super(type(self), self).__call__(x, mask, cache)
    offset = cache.offset
    if isinstance(offset, int):
        offset = _position(offset)
    queries, keys, values = self._decode_pre(x, offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.self_attn.scale, mask=mask)
    return self._decode_post(x, out)


@functools.lru_cache(maxsize=8)
def _position(offset: int) -> mx.array:
    """A cache offset as an array, the compiled RoPE's input: made once per step, not once per layer
    (every layer's cache is at the same position)."""
    return mx.array(offset, dtype=mx.int32)


def _pre(layer, x: mx.array, offset: mx.array):
    """mlx-lm's attention up to the cache: norm, projections, q/k norms, RoPE."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    B, L, _ = x.shape
    if "qkv_proj" in attn:
        qkv = attn.qkv_proj(h).reshape(B, L, attn.n_heads + 2 * attn.n_kv_heads, -1)
        queries, keys, values = mx.split(qkv, [attn.n_heads, attn.n_heads + attn.n_kv_heads], axis=2)
    else:
        queries = attn.q_proj(h).reshape(B, L, attn.n_heads, -1)
        keys = attn.k_proj(h).reshape(B, L, attn.n_kv_heads, -1)
        values = attn.v_proj(h).reshape(B, L, attn.n_kv_heads, -1)
    if "q_norm" in attn:  # qwen3
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
    return attn.rope(queries, offset=offset), attn.rope(keys, offset=offset), values


def _post(layer, x: mx.array, attended: mx.array) -> mx.array:
    """mlx-lm's block after the attention: output projection, residual, norm, MLP, residual."""
    B, _, L, _ = attended.shape
    h = x + layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))
