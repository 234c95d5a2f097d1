"""Decode speed of the engine's pieces in one process, without HTTP: where a server's tokens/s goes.

    python3 bench/gpu/profile_step.py --shape llama3-8b [--tokens 200] [--modes ...] [--json-out F]

Random weights of a real shape (bench/make_random_model.py's SHAPES), built in memory. Modes:
  stream        mlx-lm's generate_step (what stream_generate runs): the engine alone
  plain-B / ours-B     mlx-lm's BatchGenerator / engine/batch.py's generator, B sequences started
                together with prompts of one length (no padding); `r` after B: ragged lengths (padded);
                `t` after B: also the host time of building the forward pass's graph (Python) per step
  sched         our scheduler (engine/scheduler.py's Engine) in-process, one greedy request; its own timings
  prefill-plain / prefill-ours   time to the first token of a --long-prompt-token prompt
A mode may end in `+f` (fused projections, engine/fuse.py), `+c` (compiled decode steps,
engine/compiled.py) or `+fc` (both): it then runs on a copy of the model (the same random weights)
changed that way. `t` modes also time the host's share of mx.async_eval (MLX encoding the step).
Decode tokens/s are over steady steps (every sequence decoding), B sequences x steps / time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from make_random_model import SHAPES  # noqa: E402
from mlx_server.engine.batch import PadAwareBatchGenerator  # noqa: E402


TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=49152, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(shape: str, variant: str = ""):
    """The model with random weights (the same for every variant: a fixed seed), changed as `variant`
    says: f = fused projections, c = compiled decode steps."""
    from mlx_server.engine.compiled import compile_decode
    from mlx_server.engine.fuse import fuse_projections

    config = dict(TINY if shape == "tiny" else SHAPES[shape])
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if "f" in variant:
        fuse_projections(model)
    if "c" in variant:
        compile_decode(model)
    return model, config


def prompt(n: int, start: int, vocab: int) -> list[int]:
    return [(start * 131 + 7919 * i) % (vocab - 10) + 5 for i in range(n)]


def run_stream(model, vocab, tokens, plen):
    p = mx.array(prompt(plen, 1, vocab))
    times, out = [], []
    for (tok, _), _ in zip(generate_step(p, model, max_tokens=tokens), range(tokens)):
        times.append(time.perf_counter())
        out.append(int(tok))
    return {"tps": (len(times) - 1) / (times[-1] - times[0]), "tokens": out}


class Timed:
    """The model, with the host time spent building each forward pass's graph added up."""

    def __init__(self, model):
        self._model, self.build_s, self.calls = model, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self._model(*args, **kwargs)
        self.build_s += time.perf_counter() - t
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class TimedEval:
    """mx.async_eval with the host time it takes added up (MLX encoding and launching a step)."""

    def __init__(self):
        self.real, self.spent, self.calls = mx.async_eval, 0.0, 0

    def __call__(self, *args):
        t = time.perf_counter()
        self.real(*args)
        self.spent += time.perf_counter() - t
        self.calls += 1


def run_batch(cls, model, vocab, tokens, plen, b, ragged, timed=False):
    if timed:
        model = Timed(model)
        mx.async_eval = timed_eval = TimedEval()
    gen = cls(model, stop_tokens=[], completion_batch_size=32, prefill_batch_size=8)
    lens = [plen + (17 * i if ragged else 0) for i in range(b)]
    uids = gen.insert([prompt(n, i + 1, vocab) for i, n in enumerate(lens)], max_tokens=[tokens] * b)
    out = {u: [] for u in uids}
    stamps = []
    while True:
        _, responses = gen.next()
        if responses:
            stamps.append((time.perf_counter(), len(responses)))
        for r in responses:
            out[r.uid].append(r.token)
        if len(gen._generation_batch) == 0 and not gen._unprocessed_sequences and not len(gen._prompt_batch):
            break
    steady = [s for s in stamps if s[1] == b]
    n = sum(k for _, k in steady[1:])
    tps = n / (steady[-1][0] - steady[0][0]) if len(steady) > 2 else None
    gen.close()
    res = {"tps": tps, "tokens": out[uids[0]], "steady_steps": len(steady)}
    if timed:
        mx.async_eval = timed_eval.real
        res["graph_build_ms_per_call"] = 1000 * model.build_s / model.calls
        res["async_eval_ms_per_call"] = 1000 * timed_eval.spent / max(timed_eval.calls, 1)
    return res


def run_prefill(cls, model, vocab, plen):
    gen = cls(model, stop_tokens=[])
    t0 = time.perf_counter()
    gen.insert([prompt(plen, 9, vocab)], max_tokens=[2])
    while True:
        _, responses = gen.next()
        if responses:
            break
    t = time.perf_counter() - t0
    gen.close()
    return {"ttft_s": t}


def run_new_batch_sizes(model, vocab, sizes=(1, 2, 3, 4, 8, 16, 32)):
    """For each batch size, ms of the first decode step at that size (traces, kernel compilation)
    against the third: the one-time cost a new batch size costs a running server."""
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    for b in sizes:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt(16, i + 1, vocab) for i in range(b)]), cache=cache))
        spent = []
        for _ in range(3):
            t = time.perf_counter()
            mx.eval(model(mx.array([[5]] * b), cache=cache))
            spent.append(round(1000 * (time.perf_counter() - t), 2))
        out[str(b)] = spent
    return {"tps": None, "first_second_third_ms": out}


def run_sched(model, vocab, tokens, plen, tok_dir):
    from mlx_lm.utils import load_tokenizer

    from mlx_server.engine.request import GenerationRequest, SamplingParams
    from mlx_server.engine.scheduler import Engine

    tokenizer = load_tokenizer(Path(tok_dir))
    engine = Engine(model, tokenizer)
    engine.start()

    async def one(i):
        req = GenerationRequest(f"r{i}", prompt(plen, 40 + i, vocab), tokens, SamplingParams(temperature=0))
        events = [e async for e in engine.submit(req).events()]
        return events[-1]

    try:
        asyncio.run(one(0))  # warm-up
        last = asyncio.run(one(1))
    finally:
        engine.stop()
    d = last.timings.as_dict()
    return {"tps": d["predicted_per_second"], "n": last.usage.completion_tokens, "finish": last.finish_reason}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES) + ["tiny"],
                    help="tiny: a 2-layer model for a smoke test")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--modes", default="stream,plain-1,ours-1,plain-4,ours-4,plain-4r,ours-4r,sched,"
                                       "prefill-plain,prefill-ours")
    ap.add_argument("--tok", default=str(ROOT / ".gpu" / "tok"))
    ap.add_argument("--repeat", type=int, default=2, help="runs of each mode (the best is kept); the first warms up")
    ap.add_argument("--json-out")
    a = ap.parse_args()

    models = {}
    res = {}
    classes = {"plain": BatchGenerator, "ours": PadAwareBatchGenerator}
    for name in a.modes.split(","):
        mode, _, variant = name.partition("+")
        if variant not in models:
            models[variant] = build(a.shape, variant)
        model, config = models[variant]
        vocab = config["vocab_size"]
        runs = []
        for _ in range(a.repeat):
            if mode == "stream":
                r = run_stream(model, vocab, a.tokens, a.prompt)
            elif mode == "sched":
                r = run_sched(model, vocab, a.tokens, a.prompt, a.tok)
            elif mode == "newbatch":
                r = run_new_batch_sizes(model, vocab)
            elif mode.startswith("prefill-"):
                r = run_prefill(classes[mode.split("-")[1]], model, vocab, a.long_prompt)
            else:
                kind, b = mode.split("-")
                r = run_batch(classes[kind], model, vocab, a.tokens, a.prompt, int(b.rstrip("rt")), "r" in b, "t" in b)
            runs.append(r)
        if "ttft_s" in runs[0]:
            best = min(runs, key=lambda r: r["ttft_s"])
        else:
            best = max(runs, key=lambda r: r["tps"] or 0)
        res[name] = best
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items() if k != "tokens"}
        print(f"{a.shape} {name}: {shown} (all: {[round(r.get('tps') or r.get('ttft_s') or 0, 4) for r in runs]})",
              flush=True)
    toks = {m: r["tokens"] for m, r in res.items() if "tokens" in r}
    if "stream" in toks:
        for m, t in toks.items():
            same = sum(x == y for x, y in zip(t, toks["stream"]))
            print(f"  {m}: first-sequence tokens equal to stream's: {same}/{len(toks['stream'])}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"shape": a.shape, "tokens": a.tokens, "prompt": a.prompt,
                                                "results": {m: {k: v for k, v in r.items() if k != "tokens"}
                                                            for m, r in res.items()}}, indent=1))


if __name__ == "__main__":
    main()
