"""What isolating a Command agent costs per episode: its process start and first model call, isolated and not.

Each episode is an AgentEnv whose agent is an ``envkit.Command`` running a standard-library program: it reads its
task, makes one chat call (one token, from the bundled model on an in-process HF engine, through the capture
gateway) and prints how long that call took. Three ways, in rotating order within each round, one episode at a time:
  before      isolate=False, inherit_env=True: what every Command did before isolation (this user, this host's
              network, this process's whole environment)
  clean env   isolate=False with the new default environment (SAFE_ENV and the endpoint only)
  isolated    the default: network, PID and mount namespaces, and as root a uid of its own, relayed to the
              episode's own gateway port
Printed: the median per-episode wall time (process start to exit, the gateway's episode set-up and grading
included) and the median first call as the agent timed it, each with its ratio to ``before``.

    python benchmarks/agent_isolation.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from envkit import Task
from envkit.agents.agent import AgentEnv, Command
from envkit.agents.isolation import isolation
from envkit.agents.untrusted import python
from generators.chat import ChatTokenizer
from generators.engines.hf import HFEngine
from generators.models import resolve_model
from generators.rollout import Generator, GeneratorConfig

AGENT = """
import json, os, sys, time, urllib.request
task = json.load(sys.stdin)
body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 1,
        "messages": [{"role": "user", "content": task["question"]}]}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
start = time.perf_counter()
urllib.request.urlopen(request, timeout=60).read()
print(time.perf_counter() - start)
"""
WAYS = {"before": {"isolate": False, "inherit_env": True}, "clean env": {"isolate": False},
        "isolated": {"isolate": True}}


async def episode(generator: Generator, options: dict[str, Any], n: int) -> tuple[float, float]:
    """One episode's wall time and its agent's first call, in seconds."""
    calls: list[float] = []

    def grade(task: Task, printed: str) -> float:
        calls.append(float(printed))
        return 0.0

    task = {"id": f"t{n}", "question": f"What is {n} + 1?"}
    start = time.perf_counter()
    [t] = await generator.generate(lambda: AgentEnv(agent=Command([python(), "-c", AGENT], **options), grader=grade,
                                                    tasks=[task]), tasks=[task])
    wall = time.perf_counter() - start
    if t.failed:
        raise SystemExit(f"an episode failed: {t.error}")
    return wall, calls[0]


async def main(rounds: int) -> None:
    model = resolve_model(None)
    engine = HFEngine(model)
    await engine.start()
    generator = Generator(engine, ChatTokenizer.from_pretrained(model), GeneratorConfig(max_tokens=1, max_turns=1))
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    names = list(WAYS)
    await episode(generator, WAYS["before"], -1)  # warm: the gateway starts on the first episode
    for r in range(rounds):
        for way in names[r % len(names):] + names[:r % len(names)]:
            times[way].append(await episode(generator, WAYS[way], r))
    base_wall = statistics.median(w for w, _ in times["before"])
    base_call = statistics.median(c for _, c in times["before"])
    print(f"isolation on this machine: {isolation()!r}; {rounds} episodes per way")
    print(f"{'way':<10} {'episode ms':>11} {'x before':>9} {'first call ms':>14} {'x before':>9}")
    for way, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        call = statistics.median(c for _, c in samples)
        print(f"{way:<10} {wall * 1e3:>11.1f} {wall / base_wall:>9.2f} {call * 1e3:>14.1f} {call / base_call:>9.2f}")
    print(json.dumps({way: {"episode_ms": statistics.median(w for w, _ in s) * 1e3,
                            "first_call_ms": statistics.median(c for _, c in s) * 1e3} for way, s in times.items()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="episodes per way")
    asyncio.run(main(parser.parse_args().rounds))
