"""What the policy server can carry, and what it costs over the engine it fronts: the capacity the online stage's load
is stated against (docs/serving.md).

One managed vLLM server of the bundled model; at each concurrency (closed loop: each client sends its next call when
the last is answered), ``--calls`` chat calls of arithmetic questions, ``--max-tokens`` each, through

    envkit    the PolicyServer (generators/serving) with capture on: every call linked, stored and fsync'd before
              it is answered
    vllm      the same vLLM server's own OpenAI endpoint (its chat template, no store): the peer

Prints calls/s, p50 and p99 latency of each and the envkit/vllm ratios; capacity is the highest throughput envkit
reached. Run it with nothing else on the machine.

    python benchmarks/serving.py [--concurrency 1 4 8 16] [--calls 48] [--max-tokens 48] [--cpu-cores 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import openai

from generators import ChatTokenizer, GeneratorConfig, VLLMEngine, bundled_model_dir
from generators.engines.managed import ServerOptions
from generators.serving.server import Client, PolicyServer, ServingConfig
from generators.serving.store import CallStore
from generators.serving.users import percentiles

QUESTIONS = [f"What is {a} + {b}? End with 'The answer is N.'" for a in range(10) for b in range(10)]


async def load(base_url: str, key: str, model: str, concurrency: int, calls: int, max_tokens: int
               ) -> dict[str, float]:
    """``calls`` calls from ``concurrency`` clients in a closed loop: throughput and latency."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    latencies: list[float] = []
    failed = 0
    queue = list(range(calls))

    async def client() -> None:
        nonlocal failed
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            try:
                await api.chat.completions.create(model=model, max_tokens=max_tokens, temperature=1.0,
                                                  messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                latencies.append(time.perf_counter() - t0)
            except openai.APIError:
                failed += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await api.close()
    return {"calls_per_s": len(latencies) / wall, **percentiles(sorted(latencies)), "failed": failed}


async def main(args: argparse.Namespace) -> dict[str, object]:
    model = bundled_model_dir()
    engine = VLLMEngine(model, ServerOptions(served_model_name="policy"), kv_cache_gib=1, cpu_cores=args.cpu_cores)
    tokenizer = ChatTokenizer.from_pretrained(model)
    results: dict[str, dict[int, dict[str, float]]] = {"envkit": {}, "vllm": {}}
    with tempfile.TemporaryDirectory() as tmp, CallStore(Path(tmp)) as store:
        await engine.start()
        try:
            server = PolicyServer(engine, tokenizer, ServingConfig([Client("bench", "key-bench")],
                                                                   max_concurrent=1024), store,
                                  GeneratorConfig(max_tokens=args.max_tokens))
            ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            serving = asyncio.create_task(server.serve(on_ready=ready.set_result, handle_signals=False))
            url = await ready
            assert engine.chat_url is not None
            await load(f"{url}/v1", "key-bench", "policy", 2, 8, args.max_tokens)  # warm both paths
            for c in args.concurrency:
                results["envkit"][c] = await load(f"{url}/v1", "key-bench", "policy", c, args.calls, args.max_tokens)
                results["vllm"][c] = await load(engine.chat_url, "none", "policy", c, args.calls, args.max_tokens)
                print(f"concurrency {c}: envkit {results['envkit'][c]}\n"
                      f"               vllm   {results['vllm'][c]}", flush=True)
            stored = len(store.calls())
            server.stop()
            await serving
        finally:
            await engine.stop()
    print(f"\n{'clients':>8} {'envkit/s':>9} {'vllm/s':>8} {'ratio':>6} {'p50 env':>8} {'p50 vllm':>9} "
          f"{'p99 env':>8} {'p99 vllm':>9}")
    for c in args.concurrency:
        e, v = results["envkit"][c], results["vllm"][c]
        print(f"{c:>8} {e['calls_per_s']:>9.2f} {v['calls_per_s']:>8.2f} {e['calls_per_s'] / v['calls_per_s']:>6.2f} "
              f"{e['p50']:>8.2f} {v['p50']:>9.2f} {e['p99']:>8.2f} {v['p99']:>9.2f}")
    capacity = max(r["calls_per_s"] for r in results["envkit"].values())
    print(f"\ncapacity through envkit: {capacity:.2f} calls/s of {args.max_tokens} tokens at most "
          f"({stored} calls stored, every one fsync'd before its answer)")
    return {"results": results, "capacity_calls_per_s": capacity}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cpu-cores", default="auto",
                        help="the cores the server computes on, e.g. 0, what +recipe=online serves on (default: all)")
    parser.add_argument("--out", default="runs/bench/serving.json")
    arguments = parser.parse_args()
    measured = asyncio.run(main(arguments))
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.out).write_text(json.dumps(measured, indent=2))
