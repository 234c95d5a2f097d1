"""One model across several processes or machines with MLX's own distributed engine.

`mlx.launch ... -- mlx-server --model DIR --parallel pipeline|tensor` starts one process per rank.
Every rank loads only its share of the weights; rank 0 serves HTTP and runs the scheduler; the
other ranks run the same scheduler without clients, fed step by step with rank 0's decisions
(`StepChannel`). Because every rank applies the same decisions to the same tokens, they run the
same model calls in the same order, and the collectives inside the model line up.

- pipeline: the layers are split in order across ranks (rank size-1 runs the first layers, rank 0
  the last, as mlx-lm does); the final hidden state is all-gathered, so every rank computes the
  same logits and samples the same tokens.
- tensor: mlx-lm's `shard()`: every layer's heads and channels are split across ranks.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from mlx_server.log import logger

# Model types whose inner model is the plain llama layout (embed_tokens, layers, norm, and
# layer(h, mask, cache)): our own pipeline split serves them. Models with mlx-lm's PipelineMixin
# use mlx-lm's split.
_LLAMA_LAYOUT = {"llama", "mistral", "qwen3"}


class ShardError(Exception):
    """The model cannot be split across the ranks in the asked way; the message says why."""


class GroupFailed(Exception):
    """A rank died, cannot be reached, or is out of step; the group cannot go on."""


def init_group(mode: str | None):
    """The distributed group this process belongs to, or None for a single process."""
    if not mode:
        return None
    group = mx.distributed.init()
    if group.size() == 1:
        logger.warning("--parallel %s: this process was not started by mlx.launch (one rank); serving alone", mode)
        return None
    return group


def shard_model(model, config: dict, group, mode: str) -> str:
    """Split `model` (loaded lazily, weights not yet read) for this rank; returns a description
    for the start-up log. Raises ShardError when the model cannot be split that way."""
    size, rank = group.size(), group.rank()
    if mode == "tensor":
        args = getattr(model, "args", None)
        heads = getattr(args, "num_attention_heads", None)
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        if not hasattr(model, "shard"):
            raise ShardError(f"model type {config.get('model_type')!r} has no tensor-parallel split in mlx-lm; use --parallel pipeline")
        if heads is not None and (heads % size or kv_heads % size):
            raise ShardError(
                f"--parallel tensor needs the attention heads to divide evenly over {size} ranks, "
                f"but this model has {heads} query and {kv_heads} key/value heads; use --parallel pipeline"
            )
        try:
            model.shard(group)
        except Exception as e:
            raise ShardError(f"--parallel tensor failed for this model: {e}") from e
        return f"tensor parallel: rank {rank} of {size} holds 1/{size} of every layer"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None:
        raise ShardError(f"model type {config.get('model_type')!r} has no layer list to split; use --parallel tensor")
    n = len(layers)
    if n < size:
        raise ShardError(f"--parallel pipeline needs at least one layer per rank: {n} layers, {size} ranks")
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        start, end = inner.start_idx, inner.end_idx
    elif config.get("model_type") in _LLAMA_LAYOUT and _plain_llama(inner):
        start, end = pipeline_split(n, size, rank)
        inner.layers = inner.layers[start:end]
        inner.pipeline_rank, inner.pipeline_size = rank, size
        inner.__class__ = _pipelined(type(inner))
    else:
        raise ShardError(
            f"model type {config.get('model_type')!r} cannot be split into a pipeline here "
            f"(supported: {', '.join(sorted(_LLAMA_LAYOUT))} and mlx-lm's pipelined models); try --parallel tensor"
        )
    return f"pipeline: rank {rank} of {size} holds layers {start}-{end - 1} of {n}"


def pipeline_split(n_layers: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the layers `rank` runs: an even split, the last layers on rank 0 (mlx-lm's order)."""
    base, extra = divmod(n_layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[rank + 1:])
    return start, start + counts[rank]


def _plain_llama(inner) -> bool:
    """True when every layer is full attention (no sliding windows, which need masks of their own)."""
    return all(not getattr(layer, "use_sliding", False) for layer in inner.layers) and hasattr(inner, "embed_tokens")


_PIPELINED: dict[type, type] = {}


def _pipelined(cls: type) -> type:
    """`cls` with a forward pass that receives the hidden state from the previous stage, runs this
    rank's layers, passes it on, and all-gathers the last stage's output."""
    if cls in _PIPELINED:
        return _PIPELINED[cls]
    from mlx_lm.models.base import create_attention_mask

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        rank, size = self.pipeline_rank, self.pipeline_size
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1)
            if cache[-1] is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h)[: h.shape[0]]
        return self.norm(h)

    _PIPELINED[cls] = type(f"Pipelined{cls.__name__}", (cls,), {"__call__": __call__})
    return _PIPELINED[cls]


def group_min(group, value: int) -> int:
    """The smallest of every rank's `value` (so that all ranks make the same decision)."""
    values = mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int64), group=group, stream=generation_stream)
    return int(mx.min(values).item())


def group_all(group, flag: bool) -> bool:
    """True when every rank's `flag` is."""
    return group_min(group, int(bool(flag))) == 1


@dataclass
class Step:
    """What rank 0 decided before one scheduler step: requests to add, ids to cancel, stop."""

    add: list[dict] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    stop: bool = False


class StepChannel:
    """Rank 0's scheduler decisions, broadcast to every rank once per scheduler step.

    Each step sends a small header (payload length, a checksum of the tokens rank 0 sampled in
    the previous step, a stop flag) and, only when something changed, a JSON payload. A rank whose
    own tokens disagree with rank 0's checksum is out of step and stops the group.
    A watchdog ends the process when a step takes longer than `timeout` seconds (a rank hung, or a
    network that drops packets without closing the connection).
    """

    def __init__(self, group, timeout: float = 300.0):
        self.group = group
        self.rank = group.rank()
        self.timeout = timeout
        self._busy_since: float | None = None
        self.on_timeout = None  # called from the watchdog thread, then the process must end
        if timeout > 0:
            threading.Thread(target=self._watch, name="mlx-rank-watchdog", daemon=True).start()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def exchange(self, step: Step | None, checksum: int) -> tuple[Step, int]:
        """Rank 0 passes its Step and the checksum of its last sampled tokens; every rank gets both back."""
        payload = b""
        if self.is_leader and (step.add or step.cancel):
            payload = json.dumps({"add": step.add, "cancel": step.cancel}).encode()
        stop = bool(step.stop) if self.is_leader else False
        header = [len(payload), checksum, int(stop)] if self.is_leader else [0, 0, 0]
        with self.busy():
            n, leader_sum, stop_flag = (int(v) for v in self._sum(np.array(header, dtype=np.int64)))
            data = self._sum(np.frombuffer(payload, dtype=np.uint8) if self.is_leader else np.zeros(n, np.uint8)) if n else None
        if self.is_leader:
            return step, leader_sum
        got = Step(stop=bool(stop_flag))
        if data is not None:
            decoded = json.loads(bytes(data.astype(np.uint8)).decode())
            got.add, got.cancel = decoded["add"], decoded["cancel"]
        return got, leader_sum

    def _sum(self, array: np.ndarray) -> np.ndarray:
        # On the generation stream, behind the model step mlx-lm may have started asynchronously:
        # collectives on two streams at once would interleave their bytes on the same connections.
        try:
            out = mx.distributed.all_sum(mx.array(array), group=self.group, stream=generation_stream)
            mx.eval(out)
        except RuntimeError as e:
            raise GroupFailed(str(e)) from e
        return np.array(out)

    @contextmanager
    def busy(self):
        """Marks a collective or a model step as in progress, for the watchdog."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout:
                logger.error("no progress from the other ranks for %.0f s: giving up", self.timeout)
                if self.on_timeout is not None:
                    self.on_timeout()
                return


def token_checksum(responses) -> int:
    """A cheap fingerprint of one step's sampled tokens, the same on every rank that is in step."""
    total = 0
    for r in responses:
        total = (total * 1_000_003 + int(r.uid) * 131_071 + int(r.token)) % (1 << 61)
    return total


def request_to_wire(request) -> dict:
    """The part of a GenerationRequest every rank's scheduler needs (not how the protocol reads it)."""
    return {
        "id": request.id,
        "prompt_tokens": list(request.prompt_tokens),
        "max_tokens": request.max_tokens,
        "sampling": {**asdict(request.sampling), "logit_bias": [[int(k), float(v)] for k, v in request.sampling.logit_bias.items()]},
        "stop": list(request.stop),
        "grammar": request.grammar,
        "logprobs": request.logprobs,
        "continues_text": request.continues_text,
    }


def request_from_wire(d: dict):
    from mlx_server.engine.request import GenerationRequest, SamplingParams, ThinkingBudget

    sampling = dict(d["sampling"])
    sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"]}
    if sampling["thinking_budget"] is not None:
        sampling["thinking_budget"] = ThinkingBudget(**sampling["thinking_budget"])
    return GenerationRequest(
        id=d["id"], prompt_tokens=list(d["prompt_tokens"]), max_tokens=int(d["max_tokens"]),
        sampling=SamplingParams(**sampling), stop=list(d["stop"]), grammar=d["grammar"], logprobs=d["logprobs"],
        continues_text=d["continues_text"],
    )
