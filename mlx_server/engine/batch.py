"""The continuous-batching generator the scheduler drives (mlx-lm's `BatchGenerator`)."""

from __future__ import annotations

from mlx_lm.generate import BatchGenerator


def make_batch_generator(model, **kwargs) -> BatchGenerator:
    return BatchGenerator(model, **kwargs)
