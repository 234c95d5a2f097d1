"""engine/gemv.py off CUDA: nothing changes (the kernel itself is checked on the GPU machine by
bench/gpu/kernels.py, against MLX's matmul); the shapes it takes and leaves."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_server.engine.gemv import fits, should_use, use_gemv


def test_nothing_changes_without_a_cuda_gpu():
    model = nn.Module()
    model.layers = [nn.Linear(16, 16)]
    assert use_gemv(model) == 0
    assert type(model.layers[0]) is nn.Linear
    assert not should_use("auto") and not should_use("on") and not should_use("off")


def test_one_row_of_16_bit_floats_fits_and_the_rest_does_not():
    w = mx.zeros((32, 64), mx.bfloat16)
    assert fits(mx.zeros((1, 1, 64), mx.bfloat16), w)
    assert fits(mx.zeros((64,), mx.float16), w.astype(mx.float16))
    assert not fits(mx.zeros((1, 2, 64), mx.bfloat16), w)  # two rows: a prefill chunk or a batch
    assert not fits(mx.zeros((1, 1, 64), mx.float32), w.astype(mx.float32))
    assert not fits(mx.zeros((1, 1, 64), mx.float16), w)  # dtypes differ
    assert not fits(mx.zeros((1, 1, 60), mx.bfloat16), mx.zeros((32, 60), mx.bfloat16))  # rows not 16-byte
    assert not fits(mx.zeros((1, 1, 32768), mx.bfloat16), mx.zeros((8, 32768), mx.bfloat16))  # over 48 KiB
