"""What an env snapshot costs, by where the env runs, in the same run: snapshot and restore times (medians of
``--repeats``, restore into another env of the kind) and the snapshot's size.

  in-process     guess-number and frozenlake: the env's attributes, pickled
  ws://          guess-number behind envkit serve in a child process (the local sandbox): the server's signed token
  docker         arithmetic with follow-ups in a Docker sandbox: the same token, from the server in its container,
                 and a tar of the files in its /work (empty; then 1 MB in one file; then 200 small files), restored
                 into another container
  docker commit  the sandbox container's filesystem as an image: the other way to save a Docker env, timed for
                 comparison (it holds none of the env's state in memory, and no tmpfs such as the exec dir)

    python benchmarks/snapshot_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import time
from typing import Any

import docker

import envkit
from envkit import Env


async def cost(make: Any, repeats: int, first: str, files: str | None) -> tuple[float, float, int]:
    """Median snapshot and restore seconds of an env ``make`` gives, one step into an episode (after ``files``, when
    given, made files in its sandbox), and the size."""
    env, other = make(), make()
    try:
        await env.reset(seed=1)
        await env.step(envkit.assistant(first))
        if files is not None:
            made = await env.unwrapped.sandbox.exec(files)
            assert made.exit_code == 0, made
        taken, restored = [], []
        for _ in range(repeats):
            began = time.perf_counter()
            snapshot = await env.snapshot()
            taken.append(time.perf_counter() - began)
            began = time.perf_counter()
            await other.restore(snapshot)
            restored.append(time.perf_counter() - began)
        return statistics.median(taken), statistics.median(restored), len(pickle.dumps(snapshot))
    finally:
        await asyncio.gather(env.close(), other.close())


async def commit_cost(repeats: int) -> float:
    """Median seconds of `docker commit` of a running arithmetic sandbox (the image removed after each)."""
    env: Env = envkit.make("arithmetic", sandbox="docker")
    client = docker.from_env()
    try:
        await env.reset(seed=1)
        container = client.containers.get(env.unwrapped.sandbox.name)
        took = []
        for _ in range(repeats):
            began = time.perf_counter()
            image = await asyncio.to_thread(container.commit)
            took.append(time.perf_counter() - began)
            await asyncio.to_thread(client.images.remove, image.id, force=True)
        return statistics.median(took)
    finally:
        await env.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    def docker() -> Env:
        return envkit.make("arithmetic", followups=3, sandbox="docker")

    kinds = {
        "in-process guess-number": (lambda: envkit.make("guess-number"), "50", None),
        "in-process frozenlake": (lambda: envkit.make("frozenlake"), "Down", None),
        "ws:// guess-number": (lambda: envkit.make("guess-number", sandbox="local"), "50", None),
        "docker arithmetic": (docker, "7", None),
        "docker, 1 MB file": (docker, "7", "open('blob', 'wb').write(bytes(range(256)) * 4096)"),
        "docker, 200 files": (docker, "7", "import os\nfor i in range(20):\n    os.makedirs(f'd{i}')\n    for j in "
                                           "range(10):\n        open(f'd{i}/{j}.py', 'w').write('x' * 500)"),
    }
    for name, (make, first, files) in kinds.items():
        taken, restored, size = await cost(make, args.repeats, first, files)
        print(f"{name:24s} snapshot {1000 * taken:8.2f} ms   restore {1000 * restored:8.2f} ms   {size:8d} bytes")
    print(f"{'docker commit':24s} snapshot {1000 * await commit_cost(min(args.repeats, 5)):8.2f} ms   (the "
          "container's filesystem, without the env's state)")


if __name__ == "__main__":
    asyncio.run(main())
