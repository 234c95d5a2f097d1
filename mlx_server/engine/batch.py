"""The continuous-batching generator the scheduler drives: mlx-lm's `BatchGenerator`, with its
KV caches told when they need no attention mask.

Measured on an H200 (README, Performance): one stream through this generator decodes as fast as
mlx-lm's `stream_generate`; through mlx-lm's own generator it was 15-25% slower.

mlx-lm's `BatchKVCache` always hands the model an explicit boolean mask (it allows for rows that
are left-padded to a common length). MLX's fused attention kernels take no array mask, so with a
mask every layer of every step runs the unfused attention instead (scale, QK^T matmul, masked
`where`, softmax, matmul, reshapes: several kernels and a score tensor per layer); on the CUDA
backend that is most of what made one stream through the batch generator slower than mlx-lm's
`stream_generate`, whose plain `KVCache` passes no mask for a one-token step. When no row of the
batch is padded (always so for one sequence, and for sequences that started together with prompts
of one length) the mask allows everything but the future, so `_PadAwareBatchKVCache` gives what a
`KVCache` gives: no mask for a decode step, `"causal"` for a prefill chunk, and a plain int
position instead of a per-row offsets array that every layer updated on the device every step.
Rows' padding is kept on the host, so deciding costs no device synchronization. Padded batches
(sequences of different lengths decoding together) take mlx-lm's masked path as before.

The generation step itself (mlx-lm's `GenerationBatch`: the next step's forward pass is queued with
`mx.async_eval` before this step's tokens are read, per-sequence logits processors see every token
before the next mask is computed) is unchanged.

`MLX_SERVER_PLAIN_BATCH=1` in the environment gives mlx-lm's generator unchanged (for comparison).
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, create_attention_mask


class _PadAwareBatchKVCache(BatchKVCache):
    """A `BatchKVCache` that mirrors each row's left padding on the host (`_pad`), asks for no
    explicit mask while no row is padded, and then hands the model a plain int position.

    mlx-lm keeps `offset` (each row's position, `_idx` less the row's left padding) as a device
    array that every layer adds to at every step: one more kernel per layer per step, and RoPE with
    per-row offsets. While no row is padded every row's offset is `_idx`, so `offset` is that int
    (what a `KVCache` gives the model) and the array (`_off`) is dropped; it is made again from the
    host lists when padding appears, and from then on kept on the device exactly as mlx-lm does.
    Everything else is mlx-lm's."""

    def __init__(self, left_padding):
        self._as_array = False
        self._off = None
        super().__init__(left_padding)
        self._pad = [int(p) for p in left_padding]
        self._rpad = None

    @property
    def offset(self):
        if not self._as_array and not any(self._pad):
            return self._idx
        if self._off is None:
            self._off = mx.array([self._idx - p for p in self._pad], dtype=mx.int32)
        return self._off

    @offset.setter
    def offset(self, value):
        # mlx-lm's writes: an array is the rows' offsets; an int comes from the unpadded case
        # (the property gave `_idx`), where no array is kept.
        self._off = value if isinstance(value, mx.array) else None

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> "_PadAwareBatchKVCache":
        """Turn a plain BatchKVCache (as mlx-lm's merge makes it) into one of these, in place."""
        off = cache.__dict__.pop("offset", None)
        cache.__class__ = cls
        cache._as_array, cache._off = False, off
        cache._pad = [int(p) for p in cache.left_padding.tolist()]
        rp = cache._right_padding
        cache._rpad = None if rp is None else [int(p) for p in rp.tolist()]
        return cache

    def update_and_fetch(self, keys, values):
        # mlx-lm's, but while no row is padded the offsets array is not kept (see `offset`).
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = mx.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, n_steps * self.step, v_head_dim), values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        if any(self._pad):
            self.offset = self.offset + keys.shape[2]
        else:
            self._off = None
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys_and_values()

    def trim(self, n):
        n = min(self._idx, n)
        if any(self._pad):
            self.offset = self.offset - n
        else:
            self._off = None
        self._idx -= n
        return n

    @property
    def unpadded(self) -> bool:
        return self._rpad is None and self._right_padding is None and not any(self._pad)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if self.unpadded and not kwargs:
            # What KVCache gives: None for one token, "causal" (bottom-right aligned) for more.
            return create_attention_mask(N, offset=self._idx, return_array=return_array, window_size=window_size)
        return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if left_padding is not None:
            self._pad = [p + int(q) for p, q in zip(self._pad, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._rpad = [int(p) for p in right_padding]

    def finalize(self):
        super().finalize()  # offsets -= right padding, with the padding before it (as `offset` reads it)
        if self._rpad is not None:
            self._pad = [p + q for p, q in zip(self._pad, self._rpad)]
            self._rpad = None

    def filter(self, batch_indices):
        # mlx-lm's, except that the common padding to drop is known on the host: mlx-lm reads it back
        # from the device, which waits for the step already queued.
        idx = batch_indices.tolist() if hasattr(batch_indices, "tolist") else list(batch_indices)
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        if self._off is not None:
            self._off = self._off[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        pad = [self._pad[i] for i in idx]
        shift = min(pad) if pad else 0
        if shift > 0:
            if self.keys is not None:
                self.keys = self.keys[..., shift:, :]
                self.values = self.values[..., shift:, :]
            self._idx -= shift
            self.left_padding -= shift
        self._pad = [p - shift for p in pad]
        if self._rpad is not None:
            self._rpad = [self._rpad[i] for i in idx]

    def extend(self, other):
        # mlx-lm's concatenates the rows' offsets: let both caches hand out arrays meanwhile.
        self._as_array = True
        if isinstance(other, _PadAwareBatchKVCache):
            other._as_array = True
        try:
            if self._rpad is not None or getattr(other, "_rpad", None) is not None:
                super().extend(other)  # not a case mlx-lm makes (batches are extended before or after prefill)
                self._pad = [int(p) for p in self.left_padding.tolist()]
                return
            other_pad = _host_pad(other)
            if self.keys is None and other.keys is None:
                pad = self._pad + other_pad
            else:  # mlx-lm right-aligns both at the longer one's index
                top = max(self._idx, other._idx)
                pad = [p + top - self._idx for p in self._pad] + [p + top - other._idx for p in other_pad]
            super().extend(other)
            self._pad = pad
        finally:
            self._as_array = False
            if isinstance(other, _PadAwareBatchKVCache):
                other._as_array = False

    def extract(self, idx):
        # mlx-lm's reads the padding back from the device (a synchronization); ours is on the host.
        cache = KVCache()
        start = self._pad[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start : self._idx])
        cache.offset = cache.keys.shape[2]
        return cache

    @property
    def state(self):
        return BatchKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        BatchKVCache.state.fset(self, v)
        self._pad = [int(p) for p in self.left_padding.tolist()]
        self._rpad = None
        if not any(self._pad):
            self._off = None


def _host_pad(cache) -> list[int]:
    pad = getattr(cache, "_pad", None)
    return list(pad) if pad is not None else [int(p) for p in cache.left_padding.tolist()]


class PadAwareBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose batches' plain `BatchKVCache`s are `_PadAwareBatchKVCache`s."""

    def _make_batch(self, n: int):
        batch = super()._make_batch(n)
        batch.prompt_cache = [
            _PadAwareBatchKVCache.adopt(c) if type(c) is BatchKVCache else c for c in batch.prompt_cache
        ]
        return batch


def make_batch_generator(model, **kwargs) -> BatchGenerator:
    if os.environ.get("MLX_SERVER_PLAIN_BATCH", "") not in ("", "0"):
        return BatchGenerator(model, **kwargs)
    return PadAwareBatchGenerator(model, **kwargs)
