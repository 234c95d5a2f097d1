"""Memory limits: MLX's allocator limits, and the KV-cache budget the scheduler admits against.

Without a budget, enough long concurrent generations grow the KV cache until MLX fails an
allocation (Metal) or the operating system kills the process (CPU); with one, a request
waits for room, finishes with `length`, or is refused up front with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

# Activations, prefill buffers and the MLX free-buffer cache live beside the KV cache.
KV_SHARE_OF_FREE_MEMORY = 0.75
DEFAULT_CACHE_LIMIT = 1 << 30


@dataclass
class MemoryPlan:
    memory_limit: int  # bytes; MLX's guideline for all its allocations (enforced on Metal only)
    cache_limit: int  # bytes of freed buffers MLX keeps for reuse
    weights: int  # bytes held by the model's parameters
    kv_bytes_per_token: int  # 0 when the architecture is unknown
    kv_limit: int  # bytes of KV cache the running generations may use; 0 = no cap

    @property
    def kv_tokens(self) -> int:
        """The budget in tokens (summed over the batch as it is padded); 0 = no cap."""
        return self.kv_limit // self.kv_bytes_per_token if self.kv_limit and self.kv_bytes_per_token else 0


def kv_bytes_per_token(model) -> int:
    """Keys plus values of one token in every attention layer, from the model's config; 0 if unknown."""
    args = getattr(model, "args", None)
    layers = getattr(model, "layers", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    n_layers = len(layers) if layers is not None else getattr(args, "num_hidden_layers", 0) or 0
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else 0)
    if not (n_layers and kv_heads and head_dim):
        return 0
    return 2 * n_layers * kv_heads * head_dim * _activation_dtype(model).size


def _activation_dtype(model) -> mx.Dtype:
    """Activations (and so the KV cache) take the dtype of the floating-point weights."""
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


def weights_bytes(model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def device_memory_limit() -> int:
    """A safe default: the GPU's recommended working set on Metal (MLX's own default is 1.5x that),
    else MLX's default (80% of RAM on CPUs)."""
    recommended = mx.device_info().get("max_recommended_working_set_size")
    return int(recommended) if recommended else mx.get_memory_limit()


def plan_memory(
    model,
    *,
    ctx_size: int,
    prompt_cache_bytes: int,
    memory_limit: int | None = None,
    cache_limit: int | None = None,
    kv_limit: int | None = None,
) -> MemoryPlan:
    """Explicit values win; `None` means the default described in the README's option table."""
    memory = memory_limit or device_memory_limit()
    cache = min(DEFAULT_CACHE_LIMIT, memory // 4) if cache_limit is None else cache_limit
    weights = weights_bytes(model)
    per_token = kv_bytes_per_token(model)
    if kv_limit is None:
        free = memory - weights - prompt_cache_bytes - cache
        # Never below one full context: the operator asked for --ctx-size, so one request must fit.
        kv_limit = max(int(free * KV_SHARE_OF_FREE_MEMORY), ctx_size * per_token)
    return MemoryPlan(memory, cache, weights, per_token, kv_limit)


def apply_mlx_limits(plan: MemoryPlan) -> None:
    mx.set_memory_limit(plan.memory_limit)
    mx.set_cache_limit(plan.cache_limit)


def batch_fits(needs: list[int], budget: int) -> bool:
    """Whether sequences needing these many tokens each fit in `budget` tokens together.

    mlx-lm pads every sequence of a batch to the longest one, so a batch of n costs
    n times its longest sequence, not the sum.
    """
    return not budget or not needs or len(needs) * max(needs) <= budget


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
