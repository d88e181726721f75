"""Generator overhead over raw vLLM requests, single-turn and multi-turn, on one real vLLM-CPU server.

For each workload the Generator runs rollouts; then the exact same completion requests (same prompt ids, same
greedy sampling, so vLLM produces the same tokens; per-request seeds would crash vllm-cpu 0.32) are replayed raw
with httpx at the same concurrency. The difference is what the Generator adds: env calls, chat-template
tokenization, bookkeeping.
Target: <= 15% overhead.

    python benchmarks/generator_overhead.py [--rollouts 64] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from generators.chat import ChatTokenizer
from generators.engines.base import SamplingParams
from generators.engines.vllm import VLLMEngine
from generators.models import resolve_model
from generators.rollout import Generator, GeneratorConfig, env_factory
from generators.trajectory import Trajectory

WORKLOADS = {
    "single-turn (arithmetic)": ("arithmetic", {}),
    "multi-turn (guess-number, 4 turns)": ("guess-number", {"max_turns": 4}),
}


def turn_prompts(traj: Trajectory) -> list[list[int]]:
    """The prompt of every model turn: the prompt plus the response up to where that turn started."""
    prompts, ids = [], list(traj.prompt_ids)
    previous = 0
    for token, mask in zip(traj.response_ids, traj.loss_mask, strict=True):
        if mask == 1 and previous == 0:
            prompts.append(list(ids))
        ids.append(token)
        previous = mask
    return prompts


async def replay_raw(base_url: str, model: str, trajs: list[Trajectory], sampling: SamplingParams,
                     concurrency: int) -> tuple[float, int]:
    """Send the trajectories' requests straight to vLLM (turns of one rollout in order); (seconds, tokens)."""
    limit = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=512, max_keepalive_connections=512)) as client:

        async def rollout(prompts: list[list[int]]) -> None:
            nonlocal tokens
            async with limit:
                for prompt in prompts:
                    body = {"model": model, "prompt": prompt, "max_tokens": sampling.max_tokens,
                            "temperature": sampling.temperature, "top_p": sampling.top_p,
                            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}
                    response = await client.post("/v1/completions", json=body)
                    response.raise_for_status()
                    tokens += len(response.json()["choices"][0]["token_ids"])

        start = time.perf_counter()
        await asyncio.gather(*(rollout(turn_prompts(t)) for t in trajs))
        return time.perf_counter() - start, tokens


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="HF checkpoint dir, or 'bundled'")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts per workload")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per model turn")
    parser.add_argument("--concurrency", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    args = parser.parse_args()

    model = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_pretrained(model)
    async with VLLMEngine(model) as engine:
        config = GeneratorConfig(temperature=0.0, max_tokens=args.max_tokens, concurrency=args.concurrency, max_turns=8)
        generator = Generator(engine, tokenizer, config)
        await generator.generate(env_factory("arithmetic"), seeds=range(8))  # warm-up
        print(f"{'workload':<36} {'raw s':>7} {'gen s':>7} {'raw tok/s':>10} {'gen tok/s':>10} {'overhead':>9}")
        for label, (name, kwargs) in WORKLOADS.items():
            gen_times, raw_times = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                trajs = await generator.generate(env_factory(name, **kwargs), seeds=range(args.rollouts))
                gen_times.append(time.perf_counter() - start)
                failed = [t.error for t in trajs if t.failed]
                if failed:
                    raise SystemExit(f"{len(failed)} rollouts failed, e.g. {failed[0]}")
                gen_tokens = sum(t.num_model_tokens for t in trajs)
                raw_s, raw_tokens = await replay_raw(engine.base_url, engine.model_name, trajs, config.sampling,
                                                     args.concurrency)
                raw_times.append(raw_s)
                if raw_tokens != gen_tokens:
                    print(f"  note: replay sampled {raw_tokens} tokens vs {gen_tokens} (sampling not reproduced)")
            gen_s, raw_s = statistics.median(gen_times), statistics.median(raw_times)
            print(f"{label:<36} {raw_s:7.2f} {gen_s:7.2f} {gen_tokens / raw_s:10.1f} {gen_tokens / gen_s:10.1f} "
                  f"{(gen_s / raw_s - 1) * 100:8.1f}%")
    print("\noverhead = Generator wall time / raw replay wall time - 1 (target <= 15%)")


if __name__ == "__main__":
    asyncio.run(main())
