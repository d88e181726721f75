"""``python`` and ``bash`` tools for agents: model-written code runs in a sandbox leased for the episode.

Subclass :class:`CodeTools` (both tools), :class:`PythonTool` or :class:`BashTool` instead of
:class:`envkit.ToolEnv`, and the model may call them next to the env's own ``@tool`` methods::

    class Puzzles(CodeTools):
        async def start_episode(self, *, seed, task): ...
        async def grade(self, answer): ...

An episode's first call leases a sandbox from a warm pool that every env of this event loop shares: a locked-down
container of the runner image with ``code_sandbox="docker"``, an ``envkit serve`` child process (no isolation) with
``"local"``, docker when an engine answers with ``"auto"`` (``await env.warm()`` opens the pool before any call, as
the trainer does when a run opens). Each call is a new process in the sandbox's working
directory, so files persist from one call to the next within the episode; it is killed with everything it started
after ``code_timeout_s``, and its output is capped. The episode's end (a terminating step, the next ``reset``, or
``close``) hands the sandbox back; the pool scrubs it (processes killed, files deleted) and replaces it unless it
came back clean. The container holds no env code or data, so graders stay out of the code's reach.

The pool lives as long as the event loop: ``asyncio.run`` and ``asyncio.Runner`` close it (removing its
containers) when they shut the loop down, :func:`close_code_pools` sooner; a process killed before that leaves
containers the reaper removes on the next start. An env served from a container (``sandbox="docker"``) cannot
lease containers itself: run it in-process or behind ``envkit serve`` on a host with a Docker engine.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import Any, ClassVar

from envkit.core import Snapshot, StepResult, Task, check_kind, pickled_state
from envkit.messages import Message, system
from envkit.tool_env import ToolEnv
from envkit.tools import ToolOutput, ToolStatus, tool
from sandboxes.base import ExecResult, Sandbox, SandboxLimits
from sandboxes.env import _auto_kind, open_pool
from sandboxes.pool import SandboxPool

log = logging.getLogger(__name__)

RUNNER = "sandboxes.tools:Runner"
"""What a code-tool sandbox serves: its server is there for ``/exec``; the env itself does nothing."""
TOOL_LIMITS = SandboxLimits(output_limit_bytes=16 * 1024)

_PoolKey = tuple[asyncio.AbstractEventLoop, str, SandboxLimits, int]
_pools: dict[_PoolKey, asyncio.Future[SandboxPool]] = {}
_keepers: set[asyncio.Task[None]] = set()


class Runner(ToolEnv):
    """The env a code-tool sandbox serves: nothing to solve; the sandbox exists to run code through ``/exec``."""

    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[Message], dict]:
        return [system("This server runs code for tool calls; it has no episodes.")], {}

    async def grade(self, answer: str) -> tuple[float, dict[str, Any]]:
        return 0.0, {}


async def code_pool(kind: str = "auto", *, limits: SandboxLimits = TOOL_LIMITS, size: int = 4) -> SandboxPool:
    """The started pool of runner sandboxes this event loop shares for ``kind`` (docker, local or auto), ``limits``
    and ``size``; made on first use and closed when the loop shuts down. ``auto`` is decided once, as the pool
    opens: every episode of the loop then runs its code in the same kind of sandbox."""
    key = (asyncio.get_running_loop(), kind, limits, size)
    if key not in _pools:  # concurrent first calls share one opening
        _pools[key] = asyncio.ensure_future(_open(key, kind, limits, size))
    return await asyncio.shield(_pools[key])


async def _open(key: _PoolKey, kind: str, limits: SandboxLimits, size: int) -> SandboxPool:
    """Open the pool ``key`` names and hand it to a keeper; a failed opening is forgotten, so the next call retries."""
    try:
        if kind == "auto":
            kind = await asyncio.to_thread(_auto_kind, RUNNER)
        if kind == "local":
            log.warning("code tools run in local process sandboxes: model-written code runs on this host, unisolated")
        pool = await open_pool(RUNNER, kind, size=size, limits=limits, wait=False)
    except BaseException:
        _pools.pop(key, None)
        raise
    keeper = asyncio.ensure_future(_keep(key, pool))
    _keepers.add(keeper)
    keeper.add_done_callback(_keepers.discard)
    return pool


async def _keep(key: _PoolKey, pool: SandboxPool) -> None:
    """Hold ``pool`` open until the loop cancels this task at shutdown, then drain it."""
    try:
        await asyncio.Event().wait()
    finally:
        _pools.pop(key, None)
        await pool.close()


async def close_code_pools() -> None:
    """Drain every code-tool pool of the running loop now, removing their sandboxes (the loop's shutdown does
    it otherwise)."""
    loop = asyncio.get_running_loop()
    keepers = [k for k in _keepers if k.get_loop() is loop]
    for keeper in keepers:
        keeper.cancel()
    await asyncio.gather(*keepers, return_exceptions=True)


class CodeSandboxEnv(ToolEnv):
    """A ToolEnv that leases a runner sandbox at its episode's first code call and gives it back at the end."""

    code_sandbox: str = "auto"
    """docker, local (no isolation) or auto (docker when an engine answers); an env may set it per instance."""
    code_timeout_s: ClassVar[float] = 10.0
    """Each call is killed, with every process it started, after this many seconds."""
    code_output_chars: ClassVar[int] = 4000
    """The most characters of a call's output the model sees."""
    code_pool_size: int = 4
    """Sandboxes the shared pool keeps; episodes calling code at once beyond it wait for one (an env may set it
    per instance)."""
    code_limits: ClassVar[SandboxLimits] = TOOL_LIMITS
    snapshot_exclude = ToolEnv.snapshot_exclude | {"_lease"}

    _lease: tuple[SandboxPool, Sandbox] | None = None

    async def warm(self) -> None:
        """Open the loop's shared pool now: its sandboxes start warming before the first code call, which otherwise
        opens it (a trainer warms it while its inference server starts)."""
        await self._code_pool()

    async def run_code(self, argv: list[str]) -> ExecResult:
        """Run ``argv`` in this episode's sandbox (leased on the first call)."""
        return await (await self._sandbox()).exec(argv, timeout=self.code_timeout_s)

    async def _sandbox(self) -> Sandbox:
        """This episode's sandbox, leased from the pool on first use."""
        if self._lease is None:
            pool = await self._code_pool()
            self._lease = (pool, await pool.acquire())
        return self._lease[1]

    async def _tool_output(self, argv: list[str]) -> ToolOutput:
        """Run one code tool call: its report as the model reads it, with ``status`` error for a non-zero exit and
        timeout for a killed run, and where it ran (``sandbox``) for the run's metrics."""
        result = await self.run_code(argv)
        kind = self._lease[1].kind if self._lease else ""
        status: ToolStatus = "timeout" if result.timed_out else "error" if result.exit_code else "ok"
        return ToolOutput(self._report(result), status, {"sandbox": kind, "exec_s": round(result.duration_s, 4)})

    async def _code_pool(self) -> SandboxPool:
        return await code_pool(self.code_sandbox, limits=self.code_limits, size=self.code_pool_size)

    async def release_sandbox(self) -> None:
        """Give this episode's sandbox back to its pool, which scrubs it (a no-op when none is leased)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            await asyncio.shield(lease[0].release(lease[1]))

    async def snapshot(self) -> Snapshot:
        """The env's attributes and the files its code calls left in the episode's sandbox (none leased: none)."""
        files = await self._lease[1].save_files() if self._lease is not None else None
        return Snapshot(self.snapshot_kind, (pickled_state(self), files))

    async def restore(self, snapshot: Snapshot) -> None:
        """The snapshot's attributes, and a sandbox (leased now, where the snapshot's episode had one) holding its
        files; the sandbox this env held goes back to its pool."""
        check_kind(self, snapshot)
        state, files = snapshot.state
        await self.release_sandbox()
        vars(self).update(pickle.loads(state))
        if files is not None:
            await (await self._sandbox()).load_files(files)

    async def reset(self, *, seed: int | None = None, task: Task | None = None) -> tuple[list[Message], dict]:
        await self.release_sandbox()
        return await super().reset(seed=seed, task=task)

    async def step(self, action: Message) -> StepResult:
        result = await super().step(action)
        if result.terminated or result.truncated:
            await self.release_sandbox()
        return result

    async def close(self) -> None:
        try:
            await self.release_sandbox()
        finally:
            await super().close()

    def _report(self, result: ExecResult) -> str:
        """A call's result as the model reads it: its output, then a line for each thing that went wrong."""
        text = result.stdout.rstrip("\n")
        if result.stderr:
            text += ("\n" if text else "") + "[stderr]\n" + result.stderr.rstrip("\n")
        notes = []
        if len(text) > self.code_output_chars:
            notes.append(f"[{len(text) - self.code_output_chars} more characters cut]")
            text = text[:self.code_output_chars]
        elif result.truncated:
            notes.append("[output cut: it went past the sandbox's limit]")
        if result.timed_out:
            notes.append(f"[killed after {self.code_timeout_s:g} s]")
        elif result.exit_code:
            notes.append(f"[exit code {result.exit_code}]")
        return "\n".join([text, *notes]).strip("\n") or "[no output]"


class PythonTool(CodeSandboxEnv):
    """A ToolEnv with a ``python`` tool that runs code in the episode's sandbox."""

    @tool
    async def python(self, code: str) -> ToolOutput:
        """Run a Python 3 program in a sandbox and return what it printed (files persist between calls).

        Args:
            code: the program's source; print what you want to see
        """
        return await self._tool_output(["python3", "-I", "-c", code])


class BashTool(CodeSandboxEnv):
    """A ToolEnv with a ``bash`` tool that runs commands in the episode's sandbox."""

    @tool
    async def bash(self, command: str) -> ToolOutput:
        """Run a bash command in a sandbox and return its output (files persist between calls).

        Args:
            command: the command line, e.g. "ls -la" or "python3 solve.py"
        """
        return await self._tool_output(["bash", "-c", command])


class CodeTools(PythonTool, BashTool):
    """A ToolEnv with both the ``python`` and the ``bash`` tool."""
