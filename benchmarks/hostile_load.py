"""What one hostile client costs the honest ones on the policy server (generators/serving; docs/training/online.md):
``--clients`` honest clients call it in a closed loop, first alone and then while a hostile client keeps sending what
a server must refuse: a 5 MB and a 50 MB body (413), a prompt just inside the body limit whose text is too long for
the token budget (refused by its bytes), one that must be tokenized to be refused, JSON nested 100,000 deep and text
with a lone surrogate (400).

Prints the honest clients' p50 and p99 latency and calls/s in both phases and their ratios (with / alone), and each
hostile request's status and time to refusal. One managed vLLM server of the bundled model. Run it with nothing else on
the machine.

    python benchmarks/hostile_load.py [--clients 20] [--calls 80] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from generators import ChatTokenizer, GeneratorConfig, VLLMEngine, bundled_model_dir
from generators.engines.managed import ServerOptions
from generators.serving.server import Client, PolicyServer, ServingConfig
from generators.serving.store import CallStore
from generators.serving.users import percentiles

KEY = {"authorization": "Bearer key-bench", "content-type": "application/json"}


def hostile_bodies(tokenizer: ChatTokenizer, max_total_tokens: int) -> dict[str, bytes]:
    """What the hostile client sends, by name."""
    def chat(text: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()

    bound = max_total_tokens * tokenizer.max_text_bytes_per_token
    return {"5 MB body": chat("word " * 1_000_000), "50 MB body": chat("word " * 10_000_000),
            "prompt too long by its bytes": chat("w" * (bound + 1)),
            "prompt tokenized, then too long": chat("word " * (bound // 5 - 10)),
            "JSON nested 100,000 deep": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'}


async def honest(url: str, clients: int, calls: int, max_tokens: int) -> dict[str, float]:
    """``calls`` short chat calls from ``clients`` clients in a closed loop: throughput and latency."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    queue = list(range(calls))
    async with httpx.AsyncClient(base_url=url, headers=KEY, timeout=300) as http:
        async def client() -> None:
            while queue:
                i = queue.pop()
                t0 = time.perf_counter()
                r = await http.post("/v1/chat/completions", json={"max_tokens": max_tokens, "messages": [
                    {"role": "user", "content": f"What is {i % 10} + {i % 7}?"}]})
                statuses[r.status_code] += 1
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"calls_per_s": calls / wall, **percentiles(sorted(latencies)), "not_200": calls - statuses[200]}


async def _hostile(url: str, bodies: dict[str, bytes], stop: Any) -> dict[str, list[tuple[int, float]]]:
    answered: dict[str, list[tuple[int, float]]] = {name: [] for name in bodies}
    async with httpx.AsyncClient(base_url=url, headers=KEY, timeout=300) as http:
        while not stop.is_set():
            for name, body in bodies.items():
                t0 = time.perf_counter()
                try:
                    status = (await http.post("/v1/chat/completions", content=body)).status_code
                except httpx.HTTPError:  # the server answered 413 before the upload ended, and closed
                    status = 413
                answered[name].append((status, time.perf_counter() - t0))
    return answered


def hostile(url: str, bodies: dict[str, bytes], stop: Any, out: Any) -> None:
    """In a process of its own (its uploads take no CPU time of the server's process): send each hostile body in
    turn until ``stop`` is set, then put each one's statuses and seconds to the answer on ``out``."""
    out.put(asyncio.run(_hostile(url, bodies, stop)))


async def main(args: argparse.Namespace) -> dict[str, object]:
    model = bundled_model_dir()
    engine = VLLMEngine(model, ServerOptions(served_model_name="policy"), kv_cache_gib=1)
    tokenizer = ChatTokenizer.from_pretrained(model)
    generator = GeneratorConfig(max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp, CallStore(Path(tmp)) as store:
        await engine.start()
        try:
            server = PolicyServer(engine, tokenizer, ServingConfig([Client("bench", "key-bench")],
                                                                   max_concurrent=1024), store, generator)
            ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            serving = asyncio.create_task(server.serve(on_ready=ready.set_result, handle_signals=False))
            url = await ready
            await honest(url, 4, 8, args.max_tokens)  # warm up
            alone = await honest(url, args.clients, args.calls, args.max_tokens)
            spawn = multiprocessing.get_context("spawn")
            stop, out = spawn.Event(), spawn.Queue()
            attack = spawn.Process(target=hostile, args=(url, hostile_bodies(tokenizer, generator.max_total_tokens),
                                                         stop, out))
            attack.start()
            await asyncio.sleep(2.0)  # the hostile client is sending before the honest ones start
            attacked = await honest(url, args.clients, args.calls, args.max_tokens)
            stop.set()
            refused = await asyncio.to_thread(out.get)
            attack.join()
            server.stop()
            await serving
        finally:
            await engine.stop()
    print(f"\n{args.clients} honest clients, {args.calls} calls of {args.max_tokens} tokens each phase")
    print(f"{'':>14} {'calls/s':>8} {'p50 s':>7} {'p99 s':>7} {'not 200':>8}")
    for name, phase in (("alone", alone), ("with hostile", attacked)):
        print(f"{name:>14} {phase['calls_per_s']:>8.2f} {phase['p50']:>7.2f} {phase['p99']:>7.2f} "
              f"{phase['not_200']:>8.0f}")
    print(f"{'ratio':>14} {attacked['calls_per_s'] / alone['calls_per_s']:>8.2f} "
          f"{attacked['p50'] / alone['p50']:>7.2f} {attacked['p99'] / alone['p99']:>7.2f}")
    print("\nhostile requests (status: count, slowest answer)")
    for name, answers in refused.items():
        counts = Counter(status for status, _ in answers)
        slowest = max((s for _, s in answers), default=float("nan"))
        print(f"  {name:<32} {dict(counts)}  slowest {slowest:.2f} s")
    return {"alone": alone, "with_hostile": attacked,
            "hostile": {name: answers for name, answers in refused.items()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--calls", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="runs/bench/hostile_load.json")
    arguments = parser.parse_args()
    measured = asyncio.run(main(arguments))
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.out).write_text(json.dumps(measured, indent=2))
