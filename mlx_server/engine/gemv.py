"""A matrix-vector kernel for one token's projections on CUDA GPUs (`--gemv`).

Decoding one stream multiplies each layer's weights by a single row. On an H200, MLX 0.32's
kernel for that reads a 4096x4096 bf16 matrix at about 1.9 TB/s and a 1024x4096 one at 0.7 TB/s
(bench/gpu/kernels.py), far from the GPU's 4.8 TB/s, and the small projections of every layer add
up. This kernel (`mx.fast.cuda_kernel`) keeps the vector in shared memory and gives each warp one
output row, read with 16-byte loads and summed in float32.

`GemvLinear` is mlx-lm's `nn.Linear` whose call takes this kernel when the input is one row of
float16/bfloat16 on a CUDA GPU and the weight is contiguous; anything else (prefill chunks,
batches, CPUs, Metal, quantized layers) is `nn.Linear`'s own call.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from mlx_server.log import logger

WARPS = 8  # rows per block of 256 threads

_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mlx_server_gemv {
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }
}
"""

_SOURCE = """
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    __shared__ uint4 xs[K / 8];
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
        xs[i] = x4[i];
    }
    __syncthreads();
    if (row >= N) {
        return;
    }
    const uint4* w4 = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * K);
    float acc = 0.0f;
    #pragma unroll 8
    for (int i = lane; i < K / 8; i += 32) {
        const uint4 a = __ldg(w4 + i);
        const uint4 b = xs[i];
        const T* av = reinterpret_cast<const T*>(&a);
        const T* bv = reinterpret_cast<const T*>(&b);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc += mlx_server_gemv::to_float(av[j]) * mlx_server_gemv::to_float(bv[j]);
        }
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc += __shfl_xor_sync(0xffffffff, acc, offset);
    }
    if (lane == 0) {
        y[row] = mlx_server_gemv::from_float<T>(acc);
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="mlx_server_gemv", input_names=["w", "x"], output_names=["y"], source=_SOURCE,
                               header=_HEADER)


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def gemv(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T for an x holding one row (any leading shape of size 1) and w (N x K), K % 8 == 0."""
    n, k = w.shape
    out = _kernel()(
        inputs=[w, x],
        template=[("T", w.dtype), ("K", k), ("N", n)],
        grid=(-(-n // WARPS) * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[w.dtype],
    )
    return out[0]


def fits(x: mx.array, w: mx.array) -> bool:
    """Whether gemv() computes this call: one row, the same 16-bit float type, whole 16-byte rows,
    the vector within shared memory (48 KiB). (The kernel copies a weight that is not contiguous;
    weights as loaded, and fuse.py's joined ones, are.)"""
    k = w.shape[-1]
    return (
        x.size == k
        and w.ndim == 2
        and x.dtype == w.dtype
        and w.dtype in (mx.bfloat16, mx.float16)
        and k % 8 == 0
        and k * 2 <= 48 * 1024
    )


class GemvLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if not fits(x, w):
            return super().__call__(x)
        y = gemv(x, w)
        return y + self["bias"] if "bias" in self else y


def should_use(mode: str) -> bool:
    """`auto`: on CUDA GPUs."""
    if mode == "off":
        return False
    if not on_cuda():
        if mode == "on":
            logger.warning("--gemv on needs a CUDA GPU; MLX's own matmul is used")
        return False
    return True


def use_gemv(model) -> int:
    """Make every float nn.Linear inside the model's layers a GemvLinear; returns how many (none
    unless MLX runs on a CUDA GPU: GemvLinear does not look at the device on every call)."""
    if not on_cuda():
        return 0
    done = 0
    for layer in getattr(model, "layers", None) or []:
        for _, module in layer.named_modules():
            if type(module) is nn.Linear:
                module.__class__ = GemvLinear
                done += 1
    return done
