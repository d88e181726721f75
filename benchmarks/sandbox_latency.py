"""Sandbox latency on the real Docker engine, all on one env image (`envkit build arithmetic`):

  cold start   DockerSandbox.start(): create + start a locked-down container, then its `envkit serve` answers
               /health (what `envkit.make(NAME, sandbox="docker")` waits for before the first reset)
  engine floor what the engine alone takes to create and start a container that runs `true` on the same image,
               read-only, capabilities dropped, on the sandbox network: no server, so no sandbox starts faster
  warm acquire SandboxPool.acquire() from a pool of pre-started containers (release recycles, not timed),
               against a cold start in the same run (tests/test_sandbox_docker.py checks it is a handoff)
  exec         DockerSandbox.exec round trip: `true`, and a Python one-liner (interpreter start included)
  code tool    one `python` tool call of a CodeTools env (sandboxes.tools) on the sandbox its episode leased: the
               step a rollout takes when the model runs code, parsing and formatting included
  OpenEnv      openenv-core 0.3.0 LocalDockerProvider.start_container + wait_for_ready on the same image, run from
               .venv-openenv (its provider shells out to the docker CLI and sleeps 1 s after `docker run`)

Targets: cold start p50 <= 300 ms, exec p50 <= 5 ms, warm acquire p50 <= 50 ms. Container starts share 2 cores
with the client here: read the ratios, not the absolute numbers.

    python benchmarks/sandbox_latency.py [--runs 10] [--skip-openenv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from envkit import assistant
from sandboxes.docker import INTERNAL_NETWORK, DockerSandbox
from sandboxes.engine import docker_client, up
from sandboxes.images import build
from sandboxes.pool import SandboxPool
from sandboxes.tools import CodeTools, close_code_pools

HERE = Path(__file__).resolve().parent
OPENENV_PYTHON = HERE.parent / ".venv-openenv" / "bin" / "python"

OPENENV_PEER = """
import json, sys, time
from openenv.core.containers.runtime.providers import LocalDockerProvider

image, runs = sys.argv[1], int(sys.argv[2])
provider = LocalDockerProvider()
times = []
for _ in range(runs):
    started = time.perf_counter()
    url = provider.start_container(image)
    try:
        provider.wait_for_ready(url, timeout_s=60)
        times.append(time.perf_counter() - started)
    finally:
        provider.stop_container()
print(json.dumps(times))
"""


def _pct(values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def cold_starts(image: str, runs: int) -> list[float]:
    """Seconds from DockerSandbox.start() to a healthy server, one container at a time."""
    times = []
    for _ in range(runs):
        sandbox = DockerSandbox(image)
        started = time.perf_counter()
        await sandbox.start()
        times.append(time.perf_counter() - started)
        await sandbox.close()
    return times


def engine_floor(client: Any, image: str, runs: int) -> list[float]:
    """Seconds to create and start a container that runs `true` (no server) with the sandbox's isolation options."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        container = client.containers.create(image, command=["true"], read_only=True, init=True, cap_drop=["ALL"],
                                             security_opt=["no-new-privileges"], network=INTERNAL_NETWORK)
        container.start()
        times.append(time.perf_counter() - started)
        container.remove(force=True)
    return times


async def warm_and_exec(image: str, runs: int) -> dict[str, list[float]]:
    """Pool acquire times, and exec round trips on a pooled container."""
    out: dict[str, list[float]] = {"acquire": [], "exec true": [], "exec python": []}
    async with SandboxPool(lambda: DockerSandbox(image), size=2) as pool:
        for _ in range(runs * 3):
            started = time.perf_counter()
            sandbox = await pool.acquire()
            out["acquire"].append(time.perf_counter() - started)
            await pool.release(sandbox)
        sandbox = await pool.acquire()
        for argv, key in ((["true"], "exec true"), ("print(1)", "exec python")):
            for _ in range(runs * 2):
                started = time.perf_counter()
                result = await sandbox.exec(argv, timeout=10)
                out[key].append(time.perf_counter() - started)
                assert result.exit_code == 0, result
        await pool.release(sandbox)
    return out


class _Timed(CodeTools):
    """A CodeTools env with nothing to solve: the benchmark only calls its python tool."""

    code_sandbox = "docker"
    code_pool_size = 1
    max_turns = 1000  # one episode for every call: the lease stays, as within a real episode

    async def start_episode(self, *, seed, task):
        return [], {}

    async def grade(self, answer):
        return 0.0, {}


async def code_tool_calls(runs: int) -> list[float]:
    """Round trips of a `python` tool call on a leased (warm) runner sandbox."""
    action = assistant('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    env = _Timed()
    times = []
    try:
        await env.reset()
        await env.step(action)  # leases the sandbox (and builds the runner image the first time)
        for _ in range(runs * 2):
            started = time.perf_counter()
            result = await env.step(action)
            times.append(time.perf_counter() - started)
            assert result.observation[0]["content"] == "42", result
    finally:
        await env.close()
        await close_code_pools()
    return times


def openenv_cold_starts(image: str, runs: int) -> list[float]:
    """OpenEnv's LocalDockerProvider on the same image, in its own venv."""
    done = subprocess.run([str(OPENENV_PYTHON), "-c", OPENENV_PEER, image, str(runs)], capture_output=True,
                          text=True, timeout=60 + 30 * runs)
    if done.returncode != 0:
        raise RuntimeError(f"OpenEnv peer failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run every measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="cold starts per provider (default 10)")
    parser.add_argument("--skip-openenv", action="store_true", help="leave out OpenEnv's LocalDockerProvider")
    args = parser.parse_args()
    up()
    client = docker_client(timeout_s=600)
    image = build("arithmetic", client=client).tag
    # One start first: the engine and page cache warm up on the image either way, for both providers.
    asyncio.run(cold_starts(image, 1))
    rows: dict[str, list[float]] = {"cold start (envkit DockerSandbox)": asyncio.run(cold_starts(image, args.runs)),
                                    "engine floor (create + start, no server)": engine_floor(client, image, args.runs)}
    warm = asyncio.run(warm_and_exec(image, args.runs))
    rows["warm pool acquire"] = warm["acquire"]
    rows["exec `true` round trip"] = warm["exec true"]
    rows["exec python print(1) round trip"] = warm["exec python"]
    rows["code tool call (python print)"] = asyncio.run(code_tool_calls(args.runs))
    if not args.skip_openenv:
        rows["cold start (OpenEnv LocalDockerProvider)"] = openenv_cold_starts(image, args.runs)
    print(f"\nimage {image}, {args.runs} cold starts per provider\n")
    print(f"{'measure':<42} {'n':>4} {'p50 ms':>9} {'p95 ms':>9}")
    for name, values in rows.items():
        print(f"{name:<42} {len(values):>4} {statistics.median(values) * 1000:>9.2f} {_pct(values, 0.95) * 1000:>9.2f}")
    cold = statistics.median(rows["cold start (envkit DockerSandbox)"])
    floor = statistics.median(rows["engine floor (create + start, no server)"])
    print(f"\ncold start = engine floor {floor * 1000:.0f} ms + server start {(cold - floor) * 1000:.0f} ms")
    acquire = statistics.median(rows["warm pool acquire"])
    print(f"warm pool acquire p50 {acquire * 1000:.2f} ms: {cold / acquire:.0f}x faster than a cold start")
    for name, target in (("cold start (envkit DockerSandbox)", 0.3), ("exec `true` round trip", 0.005),
                         ("warm pool acquire", 0.05)):
        p50 = statistics.median(rows[name])
        print(f"{name}: p50 {p50 * 1000:.2f} ms {'meets' if p50 <= target else 'misses'} the <= {target * 1000:g} ms "
              "target")
    if "cold start (OpenEnv LocalDockerProvider)" in rows:
        peer = statistics.median(rows["cold start (OpenEnv LocalDockerProvider)"])
        print(f"OpenEnv LocalDockerProvider cold start p50 {peer:.3f} s: envkit is {peer / cold:.1f}x faster")


if __name__ == "__main__":
    main()
