"""Speed benchmark: our server against mlx_lm.server (and the bare engine) on one model, in one run.

Follows shared/BENCH.md: workloads single, multiturn and concurrent, run in alternation between
the servers; prints one table (ratios against mlx_lm.server) and one final JSON line.
Usage: .venv/bin/python bench/bench.py [--quick] [--model DIR] [--workloads ...] [--clients 1,4,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DEFAULT_MODEL = ROOT / ".cache" / "models" / "smollm2-135m"
REF = "mlx_lm"  # the column every ratio is taken against
COLUMNS = ["ours", "ours-4bit", REF, "engine-f32", "engine-4bit"]

SENTENCES = [
    "The old harbour town wakes up slowly, with fishing boats returning before dawn.",
    "Merchants open their shutters while gulls argue over scraps on the stone quay.",
    "A narrow road climbs from the water to a lighthouse painted red and white.",
    "Every evening the keeper writes the weather, the ships and the tides in a logbook.",
    "In winter the storms are fierce, and waves break over the wall of the pier.",
    "Children walk to the small school on the hill, past the bakery and the chapel.",
    "The market on Saturdays sells cheese, apples, wool and fresh bread from the mill.",
    "Travellers arrive by the coastal train, which stops only twice a day in summer.",
    "An old map in the town hall shows the wrecks that lie beneath the bay.",
    "At night the beam of the lighthouse sweeps across the roofs and the dark sea.",
    "The keeper's daughter wants to become an engineer and build a new harbour crane.",
    "Rumours say a chest of silver coins was lost there during a storm long ago.",
]
TOPICS = ["a lighthouse keeper", "a clockmaker", "a river pilot", "a mountain baker", "a desert astronomer",
          "a city gardener", "a ship's cook", "a village doctor", "a railway signalman", "a beekeeper",
          "a glassblower", "a cartographer", "a violin maker", "a forest ranger", "a librarian", "a potter"]


def passage(start: int, n: int) -> str:
    """n sentences (~17 tokens each) of plain English, rotated so different starts give different text."""
    return " ".join(SENTENCES[(start + i) % len(SENTENCES)] for i in range(n))


def single_messages(tag: int, sentences: int = 4) -> list[dict]:
    """The single-stream prompt, ~100 tokens with the template; `tag` makes each round's prompt distinct."""
    return [{"role": "user", "content": f"Story {tag}. Here is a setting: {passage(tag, sentences)} "
             "Write a long, detailed story set in this town, with many events and dialogue."}]


def concurrent_messages(i: int) -> list[dict]:
    """A distinct, short prompt per client (short because prefill of 4-bit weights on a CPU is ~10 tokens/s)."""
    return [{"role": "user", "content": f"Client {i}: write a long, detailed story about {TOPICS[i % len(TOPICS)]}, "
             "with many events and dialogue."}]


def turn_text(k: int, sentences: int = 5) -> str:
    """The user text of turn k of the multi-turn chat, ~100 tokens."""
    return f"Turn {k}. More notes about the town: {passage(k * 5, sentences)} Answer briefly: what happens next?"


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, model: Path, logdir: Path, variants: dict[str, list[str]]) -> dict:
    """Start one server process; returns its record (the readiness wait is separate, so all load at once)."""
    port = free_port()
    if name == REF:
        cmd = [PY, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    else:
        cmd = [PY, "-m", "mlx_server", "--model", str(model), "--port", str(port)]
        if name == "ours-4bit":
            cmd += ["--dequantize", "off"]
        cmd += variants.get(name, [])
    log = open(logdir / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return {"name": name, "url": f"http://127.0.0.1:{port}", "proc": proc, "log": logdir / f"{name}.log", "cmd": cmd}


async def wait_ready(srv: dict, timeout: float = 300) -> None:
    """Poll /health until it answers (both servers have it), then learn the model id to send."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < deadline:
            if srv["proc"].poll() is not None:
                raise RuntimeError(f"{srv['name']} exited:\n{srv['log'].read_text()[-3000:]}")
            try:
                if (await c.get(srv["url"] + "/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"{srv['name']} not ready after {timeout}s")
        if srv["name"] == REF:
            # Any other id makes mlx_lm.server load that model; its /v1/models needs a Hugging Face cache.
            srv["model"] = "default_model"
        else:
            srv["model"] = (await c.get(srv["url"] + "/v1/models")).json()["data"][0]["id"]


def weights_form(srv: dict) -> str:
    """How the server holds the weights: ours says so in its start-up log; mlx_lm.server keeps them as stored."""
    if srv["name"] == REF:
        return "4bit"
    return "f32" if "float32" in srv["log"].read_text() else "4bit"


def stop_server(srv: dict) -> None:
    srv["proc"].terminate()
    try:
        srv["proc"].wait(10)
    except subprocess.TimeoutExpired:
        srv["proc"].kill()


async def chat(client: httpx.AsyncClient, srv: dict, messages: list[dict], max_tokens: int) -> dict:
    """One streaming greedy chat request; times measured here, at the client."""
    body = {"model": srv["model"], "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    parts, usage, timings, finish, chunks = [], None, None, None, 0
    async with client.stream("POST", srv["url"] + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{srv['name']}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:].strip() == "[DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{srv['name']}: {obj['error']}")
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(text)
                    chunks += 1
                finish = choice.get("finish_reason") or finish
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
    end = time.perf_counter()
    # Count tokens as the server does; without usage, content chunks are the best guess.
    n = (usage or {}).get("completion_tokens") or chunks
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft": (first or end) - t0,
        "decode_tps": (n - 1) / (last - first) if first and last > first else None,
        "completion_tokens": n,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", (timings or {}).get("cache_n")),
        "usage_sent": usage is not None,
        "finish_reason": finish,
        "total_s": end - t0,
        "text": "".join(parts),
    }


# ---------------------------------------------------------------- the engine alone


def engine_child(form: str, model: str, messages: list[dict] | None, max_tokens: int) -> None:
    """In a subprocess: mlx-lm's stream_generate on the model, as our server holds it (f32) or as stored (4bit).

    f32 preloads OpenBLAS before mlx is imported, as our server does; 4bit does not, as mlx_lm.server."""
    if form == "f32":
        from mlx_server.engine.device import preload_openblas

        preload_openblas()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    m, tok = load(model)
    if form == "f32":
        from mlx_server.engine.device import dequantize_to_float32

        dequantize_to_float32(m)
    mx.eval(m.parameters())
    out = {"weight_bytes": sum(v.nbytes for _, v in tree_flatten(m.parameters()))}
    cache = make_prompt_cache(m)
    for _ in stream_generate(m, tok, "Hello", max_tokens=4, prompt_cache=cache):  # warm-up, as the servers get
        pass
    # KV bytes per position, for the ceiling: keys + values of every layer.
    out["kv_bytes_per_pos"] = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size for c in cache)
    if messages:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        t0 = time.perf_counter()
        times = []
        for r in stream_generate(m, tok, prompt, max_tokens=max_tokens):
            times.append(time.perf_counter())
        out.update(ttft=times[0] - t0, prompt_tokens=len(prompt), completion_tokens=len(times),
                   decode_tps=(len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
                   finish_reason=r.finish_reason)
    print("ENGINE " + json.dumps(out), flush=True)


def run_engine(form: str, model: Path, messages: list[dict] | None, max_tokens: int) -> dict:
    cmd = [PY, __file__, "--engine-child", form, "--model", str(model), "--tokens", str(max_tokens)]
    if messages:
        cmd += ["--messages", json.dumps(messages)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ENGINE ")]
    if p.returncode or not lines:
        raise RuntimeError(f"engine {form} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


# ---------------------------------------------------------------- workloads


def rotate(xs: list, k: int) -> list:
    """The order of servers in round k: rotated, so no server always goes first or last."""
    k %= len(xs)
    return xs[k:] + xs[:k]


async def run_single(servers: list[dict], engines: list[str], model: Path, args) -> dict:
    """One streaming client, 128 tokens; engine baselines run in the same alternation."""
    res = {s: [] for s in [x["name"] for x in servers] + engines}
    async with httpx.AsyncClient(timeout=None) as c:
        for rnd in range(args.rounds):
            for who in rotate([x["name"] for x in servers] + engines, rnd):
                msgs = single_messages(rnd, args.prompt_sentences or (1 if args.quick else 4))
                if who.startswith("engine-"):
                    r = await asyncio.to_thread(run_engine, who.split("-")[1], model, msgs, args.tokens)
                else:
                    r = await chat(c, next(x for x in servers if x["name"] == who), msgs, args.tokens)
                    r.pop("text")
                res[who].append(r)
                log(f"single round {rnd + 1} {who}: ttft {r['ttft']:.2f}s, {fmt(r['decode_tps'])} tok/s, "
                    f"{r['completion_tokens']} tokens ({r['finish_reason']})")
    out = {}
    for who, runs in res.items():
        out[who] = {"runs": runs,
                    "ttft": statistics.median(r["ttft"] for r in runs),
                    "decode_tps": median([r["decode_tps"] for r in runs]),
                    "prompt_tokens": runs[0].get("prompt_tokens"),
                    "completion_tokens": runs[0]["completion_tokens"]}
    return out


async def run_multiturn(servers: list[dict], args) -> dict:
    """A chat that re-sends its whole history each turn; the turns alternate between servers."""
    hist = {s["name"]: [] for s in servers}
    turns = {s["name"]: [] for s in servers}
    async with httpx.AsyncClient(timeout=None) as c:
        for k in range(1, args.turns + 1):
            for srv in rotate(servers, k):
                h = hist[srv["name"]]
                h.append({"role": "user", "content": turn_text(k, 1 if args.quick else 5)})
                r = await chat(c, srv, h, args.turn_tokens)
                h.append({"role": "assistant", "content": r.pop("text")})
                turns[srv["name"]].append(r)
                log(f"multiturn turn {k} {srv['name']}: ttft {r['ttft']:.2f}s, prompt {r['prompt_tokens']}, "
                    f"cached {r['cached_tokens']}")
    out = {}
    for name, rs in turns.items():
        ttft = [r["ttft"] for r in rs]
        out[name] = {"ttft": ttft, "prompt_tokens": [r["prompt_tokens"] for r in rs],
                     "cached_tokens": [r["cached_tokens"] for r in rs],
                     "last_over_turn2": ttft[-1] / ttft[1] if len(ttft) > 2 and ttft[1] > 0 else None}
    return out


async def run_concurrent(servers: list[dict], args) -> dict:
    """N clients at once, each a distinct prompt; total completion tokens over the wall time."""
    out = {s["name"]: {} for s in servers}
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=64)) as c:
        for i, n in enumerate(args.clients):
            for srv in rotate(servers, i):
                # Offsets keep prompts distinct across N and servers too, so no prefix cache helps.
                base = 100 * (i + 1)
                t0 = time.perf_counter()
                got = await asyncio.gather(*[chat(c, srv, concurrent_messages(base + j), args.tokens) for j in range(n)],
                                           return_exceptions=True)
                wall = time.perf_counter() - t0
                # A dropped connection is a result too (mlx_lm.server drops some at 32 clients).
                rs = [r for r in got if not isinstance(r, BaseException)]
                failed = [f"{type(r).__name__}: {r}"[:200] for r in got if isinstance(r, BaseException)]
                if not rs:
                    out[srv["name"]][n] = {"failed": len(failed), "errors": failed[:3]}
                    log(f"concurrent {n} {srv['name']}: all {n} requests failed: {failed[0]}")
                    continue
                tokens = sum(r["completion_tokens"] for r in rs)
                out[srv["name"]][n] = {"total_tps": tokens / wall, "wall_s": wall, "completion_tokens": tokens,
                                       "failed": len(failed), "errors": failed[:3],
                                       "prompt_tokens": median([r["prompt_tokens"] for r in rs]),
                                       "median_ttft": statistics.median(r["ttft"] for r in rs),
                                       "max_ttft": max(r["ttft"] for r in rs)}
                log(f"concurrent {n} {srv['name']}: {tokens / wall:.1f} tok/s total, "
                    f"median ttft {out[srv['name']][n]['median_ttft']:.2f}s, {len(failed)} failed")
    return out


# ---------------------------------------------------------------- report


def median(xs: list):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ceiling(bandwidth: float, weight_bytes: int, kv_per_pos: int, context: float) -> float:
    """Decode tokens/s if every step only read the weights and the KV cache once, at full bandwidth."""
    return bandwidth / (weight_bytes + kv_per_pos * context)


def table(res: dict, cols: list[str]) -> str:
    """Rows = metrics, columns = servers/engines; each cell of a higher-is-better or lower-is-better metric
    also shows its ratio to mlx_lm.server."""
    rows = []

    def row(label, values: dict, digits=1, ratio=True):
        ref = values.get(REF)
        cells = []
        for col in cols:
            v = values.get(col)
            cell = v if isinstance(v, str) else fmt(v, digits)
            if ratio and isinstance(v, (int, float)) and isinstance(ref, (int, float)) and ref and col != REF:
                cell += f" ({v / ref:.2f}x)"
            cells.append(cell)
        rows.append([label] + cells)

    row("weights held (MB)", {c: res["weights"][c]["bytes"] / 1e6 for c in cols if c in res["weights"]}, 0, False)
    if "single" in res:
        s = res["single"]
        row("single: prompt tokens", {c: s[c]["prompt_tokens"] for c in s}, 0, False)
        row("single: TTFT s", {c: s[c]["ttft"] for c in s}, 2)
        row("single: decode tok/s", {c: s[c]["decode_tps"] for c in s})
        row("single: decode / engine", {c: s[c].get("vs_engine") for c in s}, 2, False)
        row("single: ceiling tok/s", {c: s[c].get("ceiling_tps") for c in s}, 0, False)
        row("single: % of ceiling", {c: 100 * s[c]["of_ceiling"] if s[c].get("of_ceiling") else None for c in s}, 1, False)
    if "multiturn" in res:
        m = res["multiturn"]
        n = max(len(v["ttft"]) for v in m.values())
        for k in range(n):
            row(f"multiturn: TTFT s turn {k + 1}", {c: m[c]["ttft"][k] for c in m if k < len(m[c]["ttft"])}, 2)
        row(f"multiturn: turn{n}/turn2 TTFT", {c: m[c]["last_over_turn2"] for c in m}, 2, False)
        row(f"multiturn: prompt tokens turn {n}", {c: m[c]["prompt_tokens"][-1] for c in m}, 0, False)
        row(f"multiturn: cached tokens turn {n}", {c: m[c]["cached_tokens"][-1] for c in m}, 0, False)
    if "concurrent" in res:
        cc = res["concurrent"]
        for n in sorted({n for v in cc.values() for n in v}):
            ok = [c for c in cc if "total_tps" in cc[c].get(n, {})]
            row(f"concurrent {n}: total tok/s", {c: cc[c][n]["total_tps"] for c in ok})
            row(f"concurrent {n}: median TTFT s", {c: cc[c][n]["median_ttft"] for c in ok}, 2)
            row(f"concurrent {n}: % of ceiling", {c: 100 * cc[c][n]["of_ceiling"] for c in ok}, 1, False)
            row(f"concurrent {n}: failed requests", {c: cc[c][n]["failed"] for c in cc if n in cc[c]}, 0, False)
    header = ["metric"] + cols
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# ---------------------------------------------------------------- main


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: short prompts, fewer tokens and turns, 1 and 2 clients")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="MLX model directory (default: SmolLM2-135M, exported once)")
    p.add_argument("--workloads", default="single,multiturn,concurrent")
    p.add_argument("--clients", default=None, help="concurrent client counts (default 1,4,8; --quick 1,2)")
    p.add_argument("--servers", default="ours,ours-4bit,mlx_lm", help="server columns to run")
    p.add_argument("--ours-variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="one more column, ours-LABEL: our server with FLAGS added, e.g. "
                        "'nocompile=--compile-decode off' or 'plain=--fuse-projections=off,--compile-decode=off' "
                        "(repeatable; it joins the --servers columns)")
    p.add_argument("--ours-4bit-workloads", default=None,
                   help="workloads the ours-4bit column runs (default single: on this CPU 4-bit weights prefill at "
                        "~10 and decode at ~7 tokens/s total at any batch size, so multiturn and concurrent would "
                        "add ~2 and ~5 minutes; --quick: all)")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine baselines")
    p.add_argument("--tokens", type=int, default=None, help="completion tokens, single and concurrent (default 128; --quick 16)")
    p.add_argument("--turns", type=int, default=None, help="multiturn turns (default 10; --quick 3)")
    p.add_argument("--turn-tokens", type=int, default=None, help="completion tokens per turn (default 16; --quick 8)")
    p.add_argument("--rounds", type=int, default=1, help="single-workload rounds (median reported)")
    p.add_argument("--bandwidth", type=float, default=31e9, help="memory bandwidth in bytes/s (default 31e9, this CPU)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    p.add_argument("--prompt-sentences", type=int, default=None,
                   help="sentences (~17 tokens each) in the single-workload prompt (default 4: ~100 tokens with the template)")
    p.add_argument("--engine-forms", default="f32,4bit",
                   help="engine baselines to run: f32 (dequantized, OpenBLAS) and/or 4bit (weights as stored); "
                        "on a GPU use 4bit alone, which then means 'as stored' (bf16 stays bf16)")
    p.add_argument("--engine-child", choices=["f32", "4bit"], help=argparse.SUPPRESS)
    p.add_argument("--messages", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    q = a.quick
    a.tokens = a.tokens or (16 if q else 128)
    a.turns = a.turns or (3 if q else 10)
    a.turn_tokens = a.turn_tokens or (8 if q else 16)
    a.clients = [int(x) for x in (a.clients or ("1,2" if q else "1,4,8")).split(",")]
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.servers = [s for s in a.servers.split(",") if s]
    a.variants = {}
    for v in a.ours_variant:
        label, _, flags = v.partition("=")
        a.variants[f"ours-{label}"] = flags.replace(",", " ").split()
        a.servers.append(f"ours-{label}")
    a.ours_4bit_workloads = (a.ours_4bit_workloads or ("single,multiturn,concurrent" if q else "single")).split(",")
    return a


def ensure_model(path: Path) -> None:
    """Export the embedded SmolLM2 GGUF as an MLX directory once, for both servers to load."""
    if (path / "config.json").is_file() or path != DEFAULT_MODEL:
        return
    log(f"exporting the default model to {path}")
    subprocess.run([PY, "-c", "import sys; from mlx_server.engine.gguf import export_mlx_dir; "
                    "from mlx_server.engine.loader import default_model_path; "
                    "export_mlx_dir(default_model_path(), sys.argv[1])", str(path)], check=True, cwd=ROOT)


async def main_async(a) -> dict:
    model = Path(a.model).resolve()
    ensure_model(model)
    t_start = time.perf_counter()
    logdir = Path(tempfile.mkdtemp(prefix="mlx-bench-"))
    servers = [start_server(n, model, logdir, a.variants) for n in a.servers]
    engine_forms = a.engine_forms.split(",")
    engines = [] if a.no_engine else [f"engine-{f}" for f in engine_forms]
    res = {"machine": {"cpus": os.cpu_count(), "platform": sys.platform}, "model": str(model),
           "settings": {k: getattr(a, k) for k in ("quick", "tokens", "turns", "turn_tokens", "clients", "rounds",
                                                   "bandwidth", "workloads", "servers", "ours_4bit_workloads")},
           "commands": {s["name"]: " ".join(s["cmd"]) for s in servers}}
    res["settings"]["variants"] = a.variants
    try:
        await asyncio.gather(*[wait_ready(s) for s in servers])
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=64)) as c:
            # Warm-up: first-call allocations and kernel compilation out of the measurement. On a GPU,
            # MLX compiles kernels per shape and caches them on disk, so whichever server met a shape
            # first would pay for both: every server sees every prompt length and batch size first.
            for s in servers:
                await chat(c, s, [{"role": "user", "content": "Hello!"}], 4)
                await chat(c, s, single_messages(9999, a.prompt_sentences or 4), 4)
                for n in sorted(set(a.clients or [])):
                    await asyncio.gather(*[chat(c, s, concurrent_messages(9000 + j), 4) for j in range(n)],
                                         return_exceptions=True)  # mlx_lm.server drops some at 32
        log(f"servers ready in {time.perf_counter() - t_start:.1f}s (logs in {logdir})")

        # Bytes each form of the weights reads per token, from the engine children (they load both forms).
        if "single" in a.workloads:
            res["single"] = await run_single(servers, engines, model, a)
        forms = {}
        for form in sorted(set(engine_forms) | {weights_form(s) for s in servers}):
            col = f"engine-{form}"
            got = res.get("single", {}).get(col, {}).get("runs")
            forms[form] = got[0] if got else await asyncio.to_thread(run_engine, form, model, None, 0)
        res["weights"] = {}
        for s in servers:
            f = weights_form(s)
            res["weights"][s["name"]] = {"form": f, "bytes": forms[f]["weight_bytes"], "kv_bytes_per_pos": forms[f]["kv_bytes_per_pos"]}
        for e in engines:
            f = e.split("-")[1]
            res["weights"][e] = {"form": f, "bytes": forms[f]["weight_bytes"], "kv_bytes_per_pos": forms[f]["kv_bytes_per_pos"]}
        for col, s in res.get("single", {}).items():
            w = res["weights"][col]
            # The mean context while decoding: the prompt plus half the completion.
            ctx = (s["prompt_tokens"] or 0) + s["completion_tokens"] / 2
            s["ceiling_tps"] = ceiling(a.bandwidth, w["bytes"], w["kv_bytes_per_pos"], ctx)
            s["of_ceiling"] = s["decode_tps"] / s["ceiling_tps"] if s["decode_tps"] else None
            eng = res["single"].get(f"engine-{w['form']}")
            if eng and not col.startswith("engine") and s["decode_tps"] and eng["decode_tps"]:
                s["vs_engine"] = s["decode_tps"] / eng["decode_tps"]

        for name, run in (("multiturn", run_multiturn), ("concurrent", run_concurrent)):
            if name in a.workloads:
                res[name] = await run([s for s in servers if s["name"] != "ours-4bit" or name in a.ours_4bit_workloads], a)
        for col, by_n in res.get("concurrent", {}).items():
            w = res["weights"][col]
            for n, r in by_n.items():
                if "total_tps" not in r:
                    continue
                # n streams share one read of the weights per step; each reads its own KV cache.
                ctx = (r["prompt_tokens"] or 0) + a.tokens / 2
                r["ceiling_tps"] = n * ceiling(a.bandwidth, w["bytes"], n * w["kv_bytes_per_pos"], ctx)
                r["of_ceiling"] = r["total_tps"] / r["ceiling_tps"]
    finally:
        for s in servers:
            stop_server(s)
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


def main() -> None:
    a = parse_args()
    if a.engine_child:
        engine_child(a.engine_child, a.model, json.loads(a.messages) if a.messages else None, a.tokens)
        return
    res = asyncio.run(main_async(a))
    columns = COLUMNS[:1] + list(a.variants) + COLUMNS[1:]
    cols = [c for c in columns if c in res["weights"]]
    print(f"\nmlx-server bench: {res['model']}, {res['machine']['cpus']} CPUs, "
          f"{a.tokens} tokens, {a.turns} turns x {a.turn_tokens} tokens, clients {a.clients}, "
          f"bandwidth {a.bandwidth / 1e9:.0f} GB/s, {res['elapsed_s']:.0f}s")
    print("ours = our default, ours-4bit = --dequantize off, mlx_lm = mlx_lm.server; (x) = ratio to mlx_lm.server")
    for col, flags in a.variants.items():
        print(f"{col} = ours with {' '.join(flags)}")
    print()
    print(table(res, cols))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
