"""Fused projections: one matmul for each attention's q/k/v and one for each MLP's gate/up.

Every op of a decode step is built in Python and launched by MLX, and on a GPU small matmuls read
their weights far below the memory bandwidth (bench/gpu/kernels.py), so fewer, larger matmuls make
batched and small-model decode faster there (README, Performance). In mlx-lm's llama-family layers (llama and
mistral, qwen2, qwen3) five projections read the same input; joined along the output axis they
are two matmuls whose outputs are split into views. The weights are the same numbers, laid side
by side: float and quantized layers alike (a quantized layer's rows are quantized independently).
A layer whose projections cannot be joined exactly (different quantization, dtype or kind, as in a
GGUF file that mixes bit widths) keeps its own forward pass.

The fused classes subclass mlx-lm's and replace only `__call__`, as engine/distributed.py's
`_pipelined` does; the rest of the forward pass (RoPE, q/k norms, the cache) is mlx-lm's, step by step.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_server.log import logger

# The mlx-lm classes whose forward passes the fused ones reproduce (mistral is mlx-lm's llama).
ATTENTION = (llama.Attention, qwen2.Attention, qwen3.Attention)
MLP = (llama.MLP, qwen2.MLP, qwen3.MLP)


def should_fuse(mode: str, parallel: str | None, device: str = "cpu") -> bool:
    """`auto`: on GPUs, where it measured faster (README, Performance: an H200 decoded 8 streams of
    a Llama-3-8B shape 1.24x and one Qwen3-0.6B stream 1.22x faster, with compiled decode steps);
    on this project's CPU it measured no faster. Never with `--parallel tensor`, whose split cuts
    q, k and v separately."""
    return on_gpus_by_default("--fuse-projections", mode, parallel, device, "ranks hold slices of q, k and v")


def on_gpus_by_default(flag: str, mode: str, parallel: str | None, device: str, tensor_reason: str) -> bool:
    """A decode-step option: `on`, `off`, or `auto` = on GPUs; never with `--parallel tensor` (a
    warning when it was asked for)."""
    if parallel == "tensor":
        if mode == "on":
            logger.warning("%s on is ignored with --parallel tensor (%s)", flag, tensor_reason)
        return False
    return mode == "on" or (mode == "auto" and device == "gpu")


def fuse_projections(model) -> int:
    """Fuse q/k/v and gate/up in every layer of an mlx-lm llama-family model; returns the number of
    layers changed. Other models, layers already fused and layers that cannot be fused are left
    as they are."""
    fused = 0
    for layer in getattr(model, "layers", None) or []:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        fused_attention = type(attn) in ATTENTION and _fuse_attention(attn)
        fused_mlp = type(mlp) in MLP and _fuse_mlp(mlp)
        if fused_attention or fused_mlp:
            mx.eval(layer.parameters())  # one layer at a time: its unfused copies are freed before the next
            fused += 1
    return fused


def _fuse_attention(attn) -> bool:
    qkv = _joined([attn.q_proj, attn.k_proj, attn.v_proj])
    if qkv is None:
        return False
    q_rows, k_rows, v_rows = (p.weight.shape[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    head_dim = q_rows // attn.n_heads
    if q_rows != attn.n_heads * head_dim or k_rows != v_rows or k_rows != attn.n_kv_heads * head_dim:
        return False
    attn.qkv_proj = qkv
    del attn.q_proj, attn.k_proj, attn.v_proj
    attn.__class__ = _fused_class(type(attn), _attention_call)
    return True


def _fuse_mlp(mlp) -> bool:
    gate_up = _joined([mlp.gate_proj, mlp.up_proj])
    if gate_up is None or mlp.gate_proj.weight.shape[0] != mlp.up_proj.weight.shape[0]:
        return False
    mlp.gate_up_proj = gate_up
    del mlp.gate_proj, mlp.up_proj
    mlp.__class__ = _fused_class(type(mlp), _mlp_call)
    return True


def _joined(parts: list) -> nn.Module | None:
    """One linear layer whose output is `parts`' outputs side by side, or None when they differ in
    kind, bias, dtype or quantization (group size, bits, mode)."""
    kind, first = type(parts[0]), parts[0]
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    names = sorted(first.keys())
    for p in parts:
        if sorted(p.keys()) != names or any(not isinstance(p[n], mx.array) for n in names):
            return None
        if any(p[n].dtype != first[n].dtype or p[n].shape[1:] != first[n].shape[1:] for n in names):
            return None
    if kind is nn.QuantizedLinear:
        setting = (first.group_size, first.bits, first.mode)
        if any((p.group_size, p.bits, p.mode) != setting for p in parts):
            return None
    # A copy keeps the kind and its settings; its arrays are all replaced. (Building a new layer
    # would draw its initial weights from MLX's global random state.)
    joined = copy.copy(first)
    for n in names:
        joined[n] = mx.concatenate([p[n] for p in parts], axis=0)
    return joined


_FUSED: dict[type, type] = {}


def _fused_class(cls: type, call) -> type:
    if cls not in _FUSED:
        _FUSED[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": call})
    return _FUSED[cls]


def _attention_call(self, x: mx.array, mask=None, cache=None) -> mx.array:
    """mlx-lm's llama / qwen2 / qwen3 attention, with q, k and v cut from one projection."""
    B, L, _ = x.shape
    qkv = self.qkv_proj(x).reshape(B, L, self.n_heads + 2 * self.n_kv_heads, -1)
    queries, keys, values = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=2)
    if "q_norm" in self:  # qwen3
        queries, keys = self.q_norm(queries), self.k_norm(keys)
    queries = queries.transpose(0, 2, 1, 3)
    keys = keys.transpose(0, 2, 1, 3)
    values = values.transpose(0, 2, 1, 3)

    if cache is not None:
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries = self.rope(queries)
        keys = self.rope(keys)

    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return self.o_proj(output)


def _mlp_call(self, x: mx.array) -> mx.array:
    gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
    return self.down_proj(swiglu(gate, up))
