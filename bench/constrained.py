"""Constrained decoding speed: decode tokens/s with a `json_schema` response_format against the same
request without it, on one server, in alternation (issue 4, acceptance 6: at least 90%).

The rate is the server's own `timings.predicted_per_second` (first token to last), so prompt
processing is left out. The schema asks for a long array, so the constrained answer runs to
max_tokens like the free one.
Usage: .venv/bin/python bench/constrained.py [--model PATH] [--tokens 200] [--rounds 5] [--clients 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import ServerProcess  # noqa: E402  (the tests' real-process helper)

SCHEMA = {
    "type": "array",
    "minItems": 60,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "maxLength": 8}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["new", "core", "bot"]}, "maxItems": 3},
        },
        "required": ["name", "role", "address", "tags"],
        "additionalProperties": False,
    },
}
MESSAGES = [{"role": "user", "content": "List sixty users of our wiki as a JSON array, with name, role, address and tags."}]


async def rate(client: httpx.AsyncClient, tokens: int, constrained: bool) -> tuple[float, int]:
    body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": tokens, "stream": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "users", "strict": True, "schema": SCHEMA}}
    final = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                final = json.loads(line[6:])
    timings = final["timings"]
    return timings["predicted_per_second"], timings["predicted_n"]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model path (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", default="1", help="comma-separated numbers of concurrent requests (one batch each)")
    args = p.parse_args()
    server = ServerProcess(*(["--model", args.model] if args.model else [])).wait_ready(300)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            await rate(client, 16, True)  # warm-up: llguidance's tokenizer, the grammar path
            for clients in (int(c) for c in args.clients.split(",")):
                await measure(client, clients, args)
    finally:
        server.stop()


async def measure(client: httpx.AsyncClient, clients: int, args) -> None:
    results = {False: [], True: []}
    for i in range(args.rounds):
        for constrained in ((False, True) if i % 2 == 0 else (True, False)):
            runs = await asyncio.gather(*[rate(client, args.tokens, constrained) for _ in range(clients)])
            results[constrained] += runs
            print(f"{clients} clients, round {i}, {'json_schema' if constrained else 'free'}: "
                  + ", ".join(f"{r:.1f} tok/s ({n} tokens)" for r, n in runs), flush=True)
    free = statistics.median(r for r, _ in results[False])
    constrained = statistics.median(r for r, _ in results[True])
    summary = {"clients": clients, "tokens": args.tokens, "free_tokens_per_s": round(free, 2),
               "json_schema_tokens_per_s": round(constrained, 2), "ratio": round(constrained / free, 3)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
