"""Remote env throughput: envkit serve (REST and WebSocket) against OpenEnv's own server and client, same env logic.

For each concurrency level, every session steps an echo env (observation = the message, reward = 0.1 x its length,
never done) as fast as it can for a fixed window; the table gives steps/s over all sessions and the p50/p99 latency
of one step as the client sees it:
  envkit REST   RemoteEnv over one keep-alive HTTP/1.1 connection per session -> `envkit serve`
  envkit WS     RemoteEnv over one WebSocket per session                      -> `envkit serve`
  OpenEnv 0.3   openenv-core 0.3.0's GenericEnvClient (its WebSocket client) -> its create_app server
  OpenEnv 0.10  the same with openenv 0.10.0 (PyPI `openenv`), in a venv of its own
Each server is its own process on loopback with uvloop + httptools, and each client runs in a process of its own;
on a 2-core machine the client and server share the cores, so read ratios, not absolute numbers. The cells run in
rounds (REST, WS, each OpenEnv, then again); the table gives each variant's median over rounds, and each ratio is
the median of the rounds' own envkit/OpenEnv ratios. Each round also pads the client processes' environment by a
different length (the same for every variant in the round): on this 2-vCPU VM the size of the environment block
alone, which shifts the memory layout of a new process, moved a client's steps/s by up to 25%, so a fixed
environment would bias a run toward whichever client happened to land on a fast layout.
Targets at 64 sessions: envkit WS >= 4x OpenEnv steps/s, envkit REST >= 1x, against each OpenEnv version.

    python benchmarks/remote_env.py [--sessions 1,16,64,256] [--seconds 3] [--warmup 0.5] [--rounds 5] [--seed 0]
                                    [--openenv 0.3,0.10]

Needs the server extra in this venv, openenv-core 0.3.0 in .venv-openenv and openenv 0.10.0 in .venv-openenv10
(``make install`` sets up all three).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openenv_peer import MESSAGE, drive  # a sibling module in benchmarks/

import envkit
from envkit import Env, Message, StepResult

HERE = Path(__file__).resolve().parent
OPENENV_PYTHONS = {version: HERE.parent / venv / "bin" / "python"
                   for version, venv in (("0.3", ".venv-openenv"), ("0.10", ".venv-openenv10"))}


class EchoEnv(Env):
    """Echoes the assistant's message; reward 0.1 x its length; never done (as openenv_peer's echo env)."""

    async def reset(self, *, seed: int | None = None, task: envkit.Task | None = None) -> tuple[list[Message], dict]:
        self.count = 0
        return [envkit.user("Echo environment ready!")], {}

    async def step(self, action: Message) -> StepResult:
        self.count += 1
        text = action["content"] or ""
        return StepResult([envkit.user(text)], reward=0.1 * len(text), info={"message_length": len(text)})


class _EnvkitSession:
    def __init__(self, env: Env) -> None:
        self.env = env

    async def step(self) -> None:
        result = await self.env.step(envkit.assistant(MESSAGE))
        assert result.observation[0]["content"] == MESSAGE

    async def close(self) -> None:
        await self.env.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    """Start a server in its own process group with benchmarks/ importable; wait for /health."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    # OpenEnv's server prints a traceback for every client that disconnects: keep server output out of the table.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"server {argv} did not become healthy (exit code {proc.returncode})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_envkit(scheme: str, port: int, sessions: int, seconds: float, warmup: float, pad: int = 0) -> dict[str, Any]:
    """Drive `sessions` RemoteEnvs in a fresh process (like the OpenEnv client gets) and return its numbers."""
    code = ("import asyncio, json, remote_env as b; "
            f"print(json.dumps(asyncio.run(b.envkit_client({scheme!r}, {port}, {sessions}, {seconds}, {warmup}))))")
    return _json_from([sys.executable, "-c", code], pad)


async def envkit_client(scheme: str, port: int, sessions: int, seconds: float, warmup: float) -> dict[str, Any]:
    """The envkit client side of one cell: `sessions` RemoteEnvs over `scheme` (http or ws)."""
    async def open_session() -> _EnvkitSession:
        env = envkit.make(f"{scheme}://127.0.0.1:{port}/remote_env:EchoEnv")
        await env.reset()
        return _EnvkitSession(env)

    return await drive(open_session, sessions=sessions, seconds=seconds, warmup=warmup)


def run_openenv(version: str, port: int, sessions: int, seconds: float, warmup: float, pad: int = 0
                ) -> dict[str, Any]:
    """Drive OpenEnv's own client in the venv of OpenEnv ``version`` and return its numbers."""
    return _json_from([str(OPENENV_PYTHONS[version]), str(HERE / "openenv_peer.py"), "--url", f"http://127.0.0.1:{port}",
                       "--sessions", str(sessions), "--seconds", str(seconds), "--warmup", str(warmup)], pad)


def _json_from(argv: list[str], pad: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           "ENVKIT_BENCH_PAD": "x" * pad}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,16,64,256", help="comma-separated concurrency levels")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="untimed stepping before each window")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each cell, interleaved")
    parser.add_argument("--seed", type=int, default=0, help="picks each round's environment padding")
    parser.add_argument("--openenv", default="0.3,0.10", help="the OpenEnv versions to compare with (0.3, 0.10)")
    args = parser.parse_args()
    levels = [int(n) for n in args.sessions.split(",")]
    versions = args.openenv.split(",")
    for version in versions:
        if version not in OPENENV_PYTHONS:
            sys.exit(f"--openenv: no OpenEnv {version!r} here; the venvs are {', '.join(OPENENV_PYTHONS)}")
        if not OPENENV_PYTHONS[version].exists():
            sys.exit(f"{OPENENV_PYTHONS[version]} is missing: run `make install` (it creates the OpenEnv venvs)")

    envkit_port, openenv_ports = _free_port(), {version: _free_port() for version in versions}
    servers = []
    try:
        servers.append(_start([sys.executable, "-m", "envkit.cli", "serve", "remote_env:EchoEnv", "--port",
                               str(envkit_port), "--max-sessions", "1024"], envkit_port))
        for version, port in openenv_ports.items():
            servers.append(_start([str(OPENENV_PYTHONS[version]), "-m", "uvicorn", "--factory",
                                   "openenv_peer:create_app", "--port", str(port), "--log-level", "warning",
                                   "--no-access-log", "--loop", "uvloop", "--http", "httptools"], port))

        def measure(variant: str, n: int, pad: int) -> dict[str, Any]:
            if variant.startswith("OpenEnv "):
                version = variant.removeprefix("OpenEnv ")
                return run_openenv(version, openenv_ports[version], n, args.seconds, args.warmup, pad)
            scheme = "http" if variant == "envkit REST" else "ws"
            return run_envkit(scheme, envkit_port, n, args.seconds, args.warmup, pad)

        pick = random.Random(args.seed)
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for n in levels:
            for _ in range(args.rounds):
                pad = pick.randrange(4096)
                for variant in ("envkit REST", "envkit WS", *(f"OpenEnv {v}" for v in versions)):
                    runs.setdefault((variant, n), []).append(measure(variant, n, pad))
    finally:
        for proc in servers:
            _stop(proc)

    print(f"{'variant':<13} {'sessions':>8} {'steps/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}   (medians of "
          f"{args.rounds} rounds)")
    for (name, n), cell in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {k: statistics.median(r[k] for r in cell) for k in ("steps_per_s", "p50_ms", "p99_ms")}
        print(f"{name:<13} {n:>8} {med['steps_per_s']:>9.0f} {med['p50_ms']:>8.2f} {med['p99_ms']:>8.2f} "
              f"{sum(r['errors'] for r in cell):>6}")
        for r in cell:
            if r["first_error"]:
                print(f"{'':<13} first error: {r['first_error']}")
                break

    def ratios(variant: str, peer: str, n: int) -> list[float]:
        return [r["steps_per_s"] / (o["steps_per_s"] or float("nan"))
                for r, o in zip(runs[variant, n], runs[peer, n], strict=True)]

    for peer in (f"OpenEnv {v}" for v in versions):
        print(f"\nenvkit / {peer} steps/s (median of the rounds' ratios; each round's in brackets):")
        for n in levels:
            ws, rest = ratios("envkit WS", peer, n), ratios("envkit REST", peer, n)
            print(f"  {n:>3} sessions: WS {statistics.median(ws):.2f}x [{', '.join(f'{x:.2f}' for x in ws)}]   "
                  f"REST {statistics.median(rest):.2f}x")
        if 64 in levels:
            for variant, target in (("envkit WS", 4.0), ("envkit REST", 1.0)):
                ratio = statistics.median(ratios(variant, peer, 64))
                verdict = "meets" if ratio >= target else "MISSES"
                print(f"  {variant} / {peer} at 64 sessions: {ratio:.2f}x ({verdict} the >= {target:g}x target)")

if __name__ == "__main__":
    main()
