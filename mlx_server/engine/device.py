"""Per-platform speed choices: an optimized CPU BLAS, and the weight format for the device."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]


def preload_openblas() -> str | None:
    """Load OpenBLAS into the global symbol scope before MLX is imported (Linux only).

    The `mlx-cpu` wheel links a reference BLAS that is ~30x slower for float32 matmuls; symbols
    already in the global scope win when libmlx is loaded, so MLX then calls OpenBLAS.
    """
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    found = ctypes.util.find_library("openblas")
    for path in OPENBLAS_CANDIDATES + ([found] if found else []):
        if path and (os.path.exists(path) or not path.startswith("/")):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return None


def should_dequantize(model, mode: str) -> bool:
    """`auto`: dequantize a quantized model on the CPU when float32 weights fit in a quarter of RAM.

    On CPUs MLX's quantized matmuls do not use BLAS: float32 with OpenBLAS decodes ~2.5x faster
    and prefills far faster than 4-bit.
    """
    if mode in ("on", "off"):
        return mode == "on"
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device() != mx.cpu:
        return False
    quantized = any(name.endswith(".scales") for name, _ in tree_flatten(model.parameters()))
    if not quantized:
        return False
    params = sum(_logical_size(m) for m in _quantized_modules(model))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return params * 4 < ram / 4


def dequantize_to_float32(model) -> None:
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.set_dtype(mx.float32)


def _quantized_modules(model):
    import mlx.nn as nn

    return [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def _logical_size(module) -> int:
    rows, packed = module.weight.shape[-2:]
    return rows * packed * 32 // module.bits
