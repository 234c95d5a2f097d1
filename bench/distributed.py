"""One model on two ranks against one process: resident memory of each rank, decode speed, throughput.

    .venv/bin/python bench/distributed.py [--model DIR] [--rounds 3] [--tokens 128] [--via direct|mlx.launch]
        [--rank-env OPENBLAS_NUM_THREADS=1]

Starts `mlx-server --model DIR` alone, measures it, stops it; then two ranks of
`mlx-server --model DIR --parallel pipeline` on this machine's loopback (ring backend), measures them,
stops them. Without --model, SmolLM2-135M-Instruct (the embedded default) is
exported once as an MLX folder with its weights in two files. Memory is each process's resident set
(VmRSS, and VmHWM, its peak) after the runs; speed is measured at the client, as bench.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import PY, ROOT, chat, concurrent_messages, free_port, log, single_messages, wait_ready  # noqa: E402

LAUNCH = str(Path(PY).with_name("mlx.launch"))


def default_model() -> Path:
    out = ROOT / ".cache" / "models" / "smollm2-135m-2shards"
    if not (out / "model.safetensors.index.json").exists():
        from mlx_server.engine.gguf import export_mlx_dir
        from mlx_server.engine.loader import default_model_path

        export_mlx_dir(default_model_path(), out, shards=2)
    return out


def start(model: Path, ranks: int, args, logdir: Path) -> dict:
    port = free_port()
    cmd = [PY, "-m", "mlx_server", "--model", str(model), "--port", str(port), "--model-id", "m"]
    logfile = logdir / f"ranks{ranks}.log"
    out = open(logfile, "w")
    srv = {"name": f"{ranks} rank{'s' if ranks > 1 else ''}", "url": f"http://127.0.0.1:{port}", "log": logfile,
           "model": "m", "ranks": ranks, "extra": []}
    if ranks == 1:
        srv["proc"] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        return srv
    cmd += ["--parallel", "pipeline"]
    ring = free_port()
    if args.via == "mlx.launch":
        env_args = [a for e in args.rank_env for a in ("--env", e)]
        cmd = [LAUNCH, "--backend", "ring", "-n", str(ranks), "-p", str(ring), *env_args, "--", *cmd]
        srv["proc"] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        return srv
    # What mlx.launch does for local ranks, without its output threads (they spin on a core each).
    import os

    hostfile = logdir / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring + r}"] for r in range(ranks)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), **dict(e.split("=", 1) for e in args.rank_env)}
    procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                              env={**env, "MLX_RANK": str(r)}) for r in range(ranks)]
    srv["proc"], srv["extra"] = procs[0], procs[1:]
    return srv


def pids(srv: dict) -> list[int]:
    """The server processes, rank 0 first (ranks log their pid; a single process is the one started)."""
    if srv["ranks"] == 1:
        return [srv["proc"].pid]
    found = {}
    for line in srv["log"].read_text().splitlines():
        m = re.search(r"rank (\d+) of \d+ \(pid (\d+)\)", line)
        if m:
            found[int(m.group(1))] = int(m.group(2))
    return [found[r] for r in sorted(found)]


def memory_mib(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    get = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) / 1024  # noqa: E731
    return {"rss_mib": get("VmRSS"), "peak_rss_mib": get("VmHWM")}


async def measure(srv: dict, args) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(timeout=None) as c:
        await chat(c, srv, single_messages(0), 8)  # warm every shape the runs use
        runs = [await chat(c, srv, single_messages(1 + i), args.tokens) for i in range(args.rounds)]
        out["decode_tps"] = statistics.median(r["decode_tps"] for r in runs if r["decode_tps"])
        out["ttft_s"] = statistics.median(r["ttft"] for r in runs)
        out["completion_tokens"] = [r["completion_tokens"] for r in runs]
        t0 = time.perf_counter()
        got = await asyncio.gather(*[chat(c, srv, concurrent_messages(500 + j), args.tokens) for j in range(args.clients)])
        out[f"total_tps_{args.clients}_clients"] = sum(r["completion_tokens"] for r in got) / (time.perf_counter() - t0)
        out["texts"] = [r["text"] for r in runs]
    out["memory"] = [memory_mib(p) for p in pids(srv)]
    return out


def stop(srv: dict) -> None:
    import os

    for proc in [srv["proc"], *srv["extra"]]:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def main_async(args) -> dict:
    model = Path(args.model) if args.model else default_model()
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    results = {"model": str(model), "tokens": args.tokens, "rounds": args.rounds, "rank_env": args.rank_env, "via": args.via}
    for ranks in (1, 2):
        srv = start(model, ranks, args, logdir)
        try:
            await wait_ready(srv)
            log(f"{srv['name']}: ready")
            results[srv["name"]] = await measure(srv, args)
            log(f"{srv['name']}: {results[srv['name']]['decode_tps']:.1f} tok/s")
        finally:
            stop(srv)
    return results


def table(res: dict, clients: int) -> str:
    one, two = res["1 rank"], res["2 ranks"]
    rows = [
        ("resident memory, MiB (peak)", " / ".join(f"{m['rss_mib']:.0f} ({m['peak_rss_mib']:.0f})" for m in one["memory"]),
         " / ".join(f"rank {i}: {m['rss_mib']:.0f} ({m['peak_rss_mib']:.0f})" for i, m in enumerate(two["memory"]))),
        ("single stream: decode tokens/s", f"{one['decode_tps']:.1f}", f"{two['decode_tps']:.1f} ({two['decode_tps'] / one['decode_tps']:.2f}x)"),
        ("single stream: time to first token", f"{one['ttft_s']:.2f} s", f"{two['ttft_s']:.2f} s"),
        (f"{clients} clients: total tokens/s", f"{one[f'total_tps_{clients}_clients']:.1f}",
         f"{two[f'total_tps_{clients}_clients']:.1f}"),
        ("same greedy text", "", "yes" if one["texts"] == two["texts"] else "NO"),
    ]
    lines = ["| metric | 1 process | 2 ranks (pipeline, ring over loopback) |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an MLX model folder (default: SmolLM2 exported in two weight files)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rank-env", action="append", default=[], help="VAR=VALUE for every rank (mlx.launch --env)")
    p.add_argument("--via", choices=["direct", "mlx.launch"], default="direct",
                   help="start the ranks with mlx.launch, or directly with the variables it sets (default: "
                        "mlx.launch 0.32's output threads spin on a CPU core each, which a 2-core machine notices)")
    p.add_argument("--logdir", default="/tmp/mlx-server-bench-distributed")
    p.add_argument("--json-out", default="")
    args = p.parse_args()
    res = asyncio.run(main_async(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    print(table(res, args.clients))


if __name__ == "__main__":
    main()
