"""Single-stream decode of the decode-step variants, in one process: fused projections
(engine/fuse.py) and compiled decode steps (engine/compiled.py), each on or off.

    .venv/bin/python bench/decode_step.py [--model DIR|FILE.gguf] [--dequantize auto|on|off]
        [--variants plain,fuse,compile,fuse+compile] [--rounds 5] [--tokens 128]

Loads the model once per variant as the server does (`load_model` with `--fuse-projections` and
`--compile-decode`), then runs rounds of mlx-lm's `generate_step` on each in turn, the order
rotating every round, so a shared machine's load falls on all alike. Prints each round, the medians
of tokens/s and of the host time of building one step's graph, the ops in one step's graph, and
whether each variant's greedy tokens are the plain one's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_server.engine.device import preload_openblas  # noqa: E402

preload_openblas()

from mlx_lm.generate import generate_step  # noqa: E402

from mlx_server.engine.loader import default_model_path, load_model  # noqa: E402

EXPORTED = ROOT / ".cache" / "models" / "smollm2-135m"


def decode(model, prompt, tokens):
    """(tokens/s after the first token, the tokens): mlx-lm's generate_step, as the server decodes."""
    import mlx.core as mx

    times, out = [], []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=tokens), range(tokens)):
        times.append(time.perf_counter())
        out.append(int(tok))
    return (len(times) - 1) / (times[-1] - times[0]), out


def graph_ms(model, prompt, steps):
    """Host ms to build one decode step's graph (the median step), measured while nothing else runs:
    each step is evaluated before the next is built, unlike generate_step, which overlaps them."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prompt)[None], cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    spent = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y[None], cache=cache)
        spent.append(time.perf_counter() - t)
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
    return 1000 * statistics.median(spent)


def graph_ops(model, prompt):
    """Ops in one decode step's graph (MLX's DOT export of the logits, one node per op)."""
    import io

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    dot = io.StringIO()
    mx.export_to_dot(dot, model(mx.array([[prompt[-1]]]), cache=cache))
    return dot.getvalue().count("shape=rectangle")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model directory or .gguf file (default: bench.py's SmolLM2 export, "
                    "else the embedded SmolLM2 GGUF: the same weights)")
    ap.add_argument("--dequantize", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--variants", default="plain,fuse,compile,fuse+compile")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    args = ap.parse_args()
    path = Path(args.model) if args.model else EXPORTED if (EXPORTED / "config.json").is_file() else default_model_path()
    variants = args.variants.split(",")
    models = {v: load_model(path, dequantize=args.dequantize, fuse="on" if "fuse" in v else "off",
                            compile_decode="on" if "compile" in v else "off") for v in variants}
    vocab = models[variants[0]].tokenizer.vocab_size
    prompt = [(7919 * i) % (vocab - 10) + 5 for i in range(args.prompt)]
    for loaded in models.values():  # warm-up (and the compiled variants' traces)
        decode(loaded.model, prompt, 8)
    results = {v: [] for v in variants}
    tokens = {}
    width = max(map(len, variants))
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            tps, tokens[v] = decode(models[v].model, prompt, args.tokens)
            build_ms = graph_ms(models[v].model, prompt, 64)
            results[v].append((tps, build_ms))
            print(f"round {r + 1} {v:{width}}: {tps:6.2f} tokens/s, graph {build_ms:.3f} ms/step", flush=True)
    for v, rows in results.items():
        print(f"{v:{width}}: median {statistics.median(t for t, _ in rows):.2f} tokens/s, "
              f"graph {statistics.median(b for _, b in rows):.3f} ms/step, "
              f"{graph_ops(models[v].model, prompt)} ops/step ({models[v].weights})")
    for v in variants[1:]:
        print(f"{v}: same greedy tokens as {variants[0]}: {tokens[v] == tokens[variants[0]]}")


if __name__ == "__main__":
    main()
