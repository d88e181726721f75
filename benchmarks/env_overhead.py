"""In-process step overhead of the Env contract.

Runs the same trivial env logic four ways and prints µs/step and the overhead over calling the logic directly:
  direct     the logic as a plain function call
  async env  `await env.step(action)` on the Env subclass (coroutine + StepResult)
  checked    `await env.step(action)` on `envkit.make(...)` (ContractChecker: order + validation both ways)
  sync       `SyncEnv.step(action)` (the blocking facade: one event-loop run per step)
Target: checked-contract overhead under 20 µs per step.

    python benchmarks/env_overhead.py [--steps 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import envkit
from envkit import Env, Message, StepResult


def logic(count: int, text: str) -> tuple[Message, float, bool]:
    """The env's whole job: a new observation, a reward, and whether the episode ended."""
    return {"role": "user", "content": str(count)}, float(text == "x"), False


class TrivialEnv(Env):
    """Counts steps; reward 1 for the action 'x'. Never ends, so one episode covers the benchmark."""

    def __init__(self) -> None:
        self.count = 0

    async def reset(self, *, seed: int | None = None, task: envkit.Task | None = None) -> tuple[list[Message], dict]:
        self.count = 0
        return [{"role": "user", "content": "0"}], {}

    async def step(self, action: Message) -> StepResult:
        self.count += 1
        obs, reward, done = logic(self.count, action["content"] or "")
        return StepResult([obs], reward, terminated=done)


ACTION: Message = {"role": "assistant", "content": "x"}


def best_of(repeats: int, steps: int, run: Callable[[int], None]) -> float:
    """Median µs per step over `repeats` timed runs of `steps` steps."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        run(steps)
        times.append((time.perf_counter_ns() - start) / steps / 1000)
    return statistics.median(times)


def run_direct(steps: int) -> None:
    for count in range(1, steps + 1):
        logic(count, ACTION["content"] or "")


def async_runner(env: Env) -> Callable[[int], None]:
    async def loop(steps: int) -> None:
        await env.reset()
        for _ in range(steps):
            await env.step(ACTION)

    return lambda steps: asyncio.run(loop(steps))


def sync_runner(env: envkit.SyncEnv) -> Callable[[int], None]:
    def loop(steps: int) -> None:
        env.reset()
        for _ in range(steps):
            env.step(ACTION)

    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median is reported)")
    args = parser.parse_args()

    envkit.register("bench-trivial", TrivialEnv)
    sync_env = envkit.SyncEnv(envkit.make("bench-trivial"))
    results = {
        "direct": best_of(args.repeats, args.steps, run_direct),
        "async env": best_of(args.repeats, args.steps, async_runner(TrivialEnv())),
        "checked": best_of(args.repeats, args.steps, async_runner(envkit.make("bench-trivial"))),
        "sync": best_of(args.repeats, args.steps // 10, sync_runner(sync_env)),
    }
    sync_env.close()

    direct = results["direct"]
    print(f"{'variant':<10} {'µs/step':>9} {'overhead µs':>12} {'× direct':>9}")
    for name, us in results.items():
        print(f"{name:<10} {us:9.2f} {us - direct:12.2f} {us / direct:9.1f}")
    overhead = results["checked"] - direct
    print(f"\ncontract overhead (checked - direct): {overhead:.2f} µs/step "
          f"({'meets' if overhead < 20 else 'MISSES'} the < 20 µs target)")
    print(f"sync facade / checked async: {results['sync'] / results['checked']:.1f}×")


if __name__ == "__main__":
    main()
