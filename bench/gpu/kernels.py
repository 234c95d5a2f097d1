"""Where a decode step's GPU time goes: matvec bandwidth per projection shape, the cost of a small
kernel, and the GPU time of whole decode steps with the host out of the way.

    python3 bench/gpu/kernels.py [--shape llama3-8b]

- matvec: y = x @ W.T for one token (x: 1 x in, W: out x in, bf16), 50 chained in one eval;
  GB/s = bytes of W read / time.
- small: 1,000 chained RMSNorms / adds / RoPEs of one token's hidden state, in one eval: us each.
- chained steps: 32 decode steps built lazily (each step's argmax feeds the next) then evaluated
  at once: the host encodes while the GPU runs, so the time per step is about the GPU's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "gpu")]

import mlx.core as mx  # noqa: E402


def timed(fn, reps=3):
    best = None
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best


def matvec(out_dim, in_dim, n=50, transposed=False):
    shape = (in_dim, out_dim) if transposed else (out_dim, in_dim)
    ws = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(4)]
    x = mx.random.normal((1, 1, in_dim)).astype(mx.bfloat16)
    mx.eval(ws, x)

    def run():
        ys = []
        for i in range(n):
            ys.append(x @ ws[i % 4] if transposed else x @ ws[i % 4].T)
        return ys

    timed(run, 1)
    dt = timed(run)
    return out_dim * in_dim * 2 * n / dt / 1e9, dt / n * 1e6


def small(kind, dim=4096, n=1000):
    x = mx.random.normal((1, 1, dim)).astype(mx.bfloat16)
    w = mx.ones((dim,), mx.bfloat16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)

    def run():
        y = q if kind == "rope" else x
        for i in range(n):
            if kind == "rmsnorm":
                y = mx.fast.rms_norm(y, w, 1e-5)
            elif kind == "add":
                y = y + x
            elif kind == "rope":
                y = mx.fast.rope(y, 128, traditional=False, base=500000.0, scale=1.0, offset=i)
        return y

    timed(run, 1)
    return timed(run) / n * 1e6


def chained_steps(model, vocab, steps=32):
    from mlx_lm.models.cache import make_prompt_cache

    def run():
        cache = make_prompt_cache(model)
        y = mx.argmax(model(mx.array([[(7919 * i) % (vocab - 10) + 5 for i in range(100)]]), cache=cache)[:, -1], -1)
        mx.eval(y)
        t = time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model(y[None], cache=cache)[:, -1], -1)
        built = time.perf_counter() - t
        mx.eval(y)
        return built, time.perf_counter() - t

    run()
    res = [run() for _ in range(3)]
    built, total = min(res, key=lambda r: r[1])
    return {"host_build_ms_per_step": 1000 * built / steps, "ms_per_step": 1000 * total / steps,
            "tok_s": steps / total}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--variants", default=",c,fc", help="profile_step.py build variants for the chained steps ('none': skip them)")
    a = ap.parse_args()
    from profile_step import build

    print(mx.default_device(), flush=True)
    for o, i in [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (49152, 4096)]:
        gbs, us = matvec(o, i)
        print(f"matvec {o}x{i}: {gbs:.0f} GB/s, {us:.1f} us", flush=True)
        gbs, us = matvec(o, i, transposed=True)
        print(f"matvec {o}x{i}, W stored in x out: {gbs:.0f} GB/s, {us:.1f} us", flush=True)
    for k in ("rmsnorm", "add", "rope"):
        print(f"small {k}: {small(k):.2f} us each", flush=True)
    for variant in [] if a.variants == "none" else a.variants.split(","):
        model, config = build(a.shape, variant)
        print(f"{a.shape} chained steps +{variant}: {chained_steps(model, config['vocab_size'])}", flush=True)
        del model
        mx.clear_cache()


if __name__ == "__main__":
    main()
