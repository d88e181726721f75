"""Test envs for `envkit serve` (served as `remote_envs:ScriptedEnv` with tests/ on PYTHONPATH), and a server runner.

ScriptedEnv echoes the assistant's text back and does what special actions say:
  "bye"        terminates the episode
  "crash"      raises RuntimeError (an env crash the server must contain)
  "hang"       never answers (the server's step timeout must end it)
  "sleep:S"    answers after S seconds
  "block:S"    blocks its server's event loop for S seconds (as CPU-bound env code does), then answers
  "bad"        returns a malformed StepResult (the ContractChecker on the server must catch it)
  "odd info"   puts values JSON lacks in info (NaN, an int key, a set, a tuple); "big info" a 71-bit integer
  "numpy info" puts numpy_info() in info; "opaque info" a value JSON cannot carry at all
A reset task's "echo" comes back in the reset's info.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np

import envkit
from envkit import Env, Message, StepResult, Task, Tool
from envkit.tasks import check_task

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
OPENENV_PYTHONS = {version: REPO / venv / "bin" / "python"
                   for version, venv in (("0.3", ".venv-openenv"), ("0.10", ".venv-openenv10"))}
"""The OpenEnv venvs `make install` creates: openenv-core 0.3.0 and openenv 0.10.0."""
CLOSE_LOG_ENV = "ENVKIT_TEST_CLOSE_LOG"


def numpy_info() -> dict[str, Any]:
    """What gymnasium-style envs put in info: numpy scalars, an int8 action mask, a 10k-element array, a view."""
    grid = np.arange(24, dtype=np.int32).reshape(4, 6)
    return {"count": np.int64(3), "ratio": np.float32(0.1), "ok": np.bool_(True), "half": np.float16(1.5),
            "mask": np.array([1, 0, 1, 0, 0, 0], dtype=np.int8), "values": np.linspace(0.0, 1.0, 10_000),
            "columns": grid[:, ::2], "flags": np.array([True, False]), "nested": {"ids": [np.uint8(7), np.int16(-2)]}}


class ScriptedEnv(Env):
    """Echoes the assistant's text with a per-session prefix; special actions crash, hang, sleep or end it."""

    tools: ClassVar[list[Tool]] = [
        Tool("echo", "Repeat a text.",
             {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
    ]

    def __init__(self, prefix: str = "", max_turns: int = 1000) -> None:
        self.prefix, self.max_turns = prefix, max_turns
        self.turns = 0
        self.word = ""
        self.initialized = False

    async def init(self) -> None:
        self.initialized = True

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        if task is not None:
            self.word = check_task(task, word=str)["word"]
        else:
            self.word = f"w{seed}"
        self.turns = 0
        info = {"seed": seed, "word": self.word}
        if task is not None and "echo" in task:
            info["echo"] = task["echo"]
        return [envkit.user(f"{self.prefix}say {self.word}")], info

    async def step(self, action: Message) -> StepResult:
        text = action.get("content") or ""
        self.turns += 1
        if text == "crash":
            raise RuntimeError("deliberate crash")
        if text == "hang":
            await asyncio.sleep(3600)
        if text.startswith("sleep:"):
            await asyncio.sleep(float(text.split(":", 1)[1]))
        if text.startswith("block:"):
            time.sleep(float(text.split(":", 1)[1]))  # noqa: ASYNC251 (on purpose: a worker that is busy)
        if text == "bad":
            return StepResult("not a list of messages", 0.0)  # type: ignore[arg-type]
        if text == "odd info":  # values JSON lacks or carries only with help
            return StepResult([envkit.user(text)], 0.0,
                              info={"loss": math.nan, 3: "int key", "tags": {"a"}, "pair": (1, 2)})
        if text == "big info":
            return StepResult([envkit.user(text)], 0.0, info={"big": 2**70})
        if text == "numpy info":
            return StepResult([envkit.user(text)], 0.0, info=numpy_info())
        if text == "opaque info":
            return StepResult([envkit.user(text)], 0.0, info={"log": [1, object()]})
        done = text == "bye" or self.word in text
        return StepResult([envkit.user(f"{self.prefix}{text}")], reward=float(self.word in text),
                          terminated=done, truncated=self.turns >= self.max_turns and not done,
                          info={"turn": self.turns})

    async def close(self) -> None:
        log = os.environ.get(CLOSE_LOG_ENV)
        if log and self.initialized:  # a session's env, not the server's probe instance
            await asyncio.to_thread(_append_line, Path(log), self.prefix or "-")


class Held(ScriptedEnv):
    """ScriptedEnv with a lock in its state: not plain data, so it cannot snapshot."""

    def __init__(self, prefix: str = "", max_turns: int = 1000) -> None:
        super().__init__(prefix, max_turns)
        self.lock = threading.Lock()


class HeldButSaid(Held):
    """Held, naming its lock a resource: it snapshots the rest."""

    snapshot_exclude = frozenset({"lock"})


def _append_line(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real server subprocess on loopback (`envkit serve ...` or any command), stopped by ``stop()``."""

    def __init__(self, argv: list[str], *, port: int, env: dict[str, str] | None = None, health: str = "/health",
                 startup_s: float = 60.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="envkit-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.final_output: str | None = None  # the log's text once stopped (the file is then removed)
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), full_env.get("PYTHONPATH")]))
        # Its own process group: stop() reaches worker processes too.
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + health, timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {startup_s} s: {self.output()}")
            time.sleep(0.1)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        """What the server printed so far."""
        if self.final_output is not None:
            return self.final_output
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server's process group, wait, kill if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self.final_output is None:
            self.final_output = self.output()
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def envkit_serve(name: str, *args: str, env: dict[str, str] | None = None, port: int | None = None) -> Server:
    """Start `python -m envkit.cli serve NAME --port P ARGS...` and wait until /health answers."""
    port = port or free_port()
    return Server([sys.executable, "-m", "envkit.cli", "serve", name, "--port", str(port), *args], port=port,
                  env=env)


def error_code(response: httpx.Response) -> Any:
    """The structured error code of an error answer (fails loudly if the body is not structured)."""
    return response.json()["error"]["code"]


def openenv_server(version: str = "0.3", app: str = "openenv_peer:create_app") -> Server:
    """OpenEnv's own server (``version`` 0.3 or 0.10) with ``app``, by default the echo env of the remote-env
    benchmark (benchmarks/openenv_peer.py), run by uvicorn from its OpenEnv venv (`make install` creates both;
    OpenEnv stays out of .venv)."""
    python = OPENENV_PYTHONS[version]
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run `make install` (it creates the OpenEnv venvs)")
    port = free_port()
    return Server([str(python), "-m", "uvicorn", "--factory", app, "--port", str(port),
                   "--log-level", "warning"], port=port, env={"PYTHONPATH": str(REPO / "benchmarks")})
