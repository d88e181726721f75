"""Host processes: episodes run in a process of their own, one process serving many concurrent episodes.

:class:`HostProcess` is the calling end (the serving end is :mod:`envkit.agents.line_server`): it starts the process on
the first request, sends requests, and fails every request in flight, with the process's exit status and the tail
of its stderr, when it dies; the next request starts a new one. The verifiers adapter runs its envs' driver this
way, and an :class:`~envkit.agents.agent.AgentEnv` its agent with ``agent_process=True``:

``python -m envkit.agents.host REF`` (:mod:`envkit.agents.host`) hosts the agent ``REF`` (``module:qualname``, or
``/path/to/script.py:name`` for one defined in a script run as ``__main__``) and answers ``{"op": "run", "task":
{...}, "client": {...}}`` with what the agent returned (as JSON).

Why a process: the agents' own CPU work (an SDK building requests and parsing replies) then runs in parallel with the
generator and its capture gateway, on another core, instead of in turns on one event loop; and an agent that
blocks its event loop stalls its host's episodes, not the gateway every episode talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envkit.errors import AgentProcessError
from envkit.imports import import_ref

if TYPE_CHECKING:
    from envkit.agents.client import AgentClient
    from envkit.core import Task

START_TIMEOUT_S = 300.0
"""Seconds a host process may take to become ready (importing an SDK, loading an env)."""
CANCEL_ACK_S = 10.0
"""Seconds a host has to confirm a cancellation; one that does not is blocked (code holding its event loop) and is
killed, failing what else it runs, so that later requests get a fresh host instead of waiting behind it."""

STDERR_AFTER_EXIT_S = 2.0
"""Seconds to wait, once a host has exited, for the rest of its stderr (a child it started may hold the pipe)."""


class HostProcess:
    """One host process (``argv``) serving this event loop's requests, and the requests in flight to it; ``name``
    says what it is in errors."""

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.argv, self.name, self.env = argv, name, env
        self.process: asyncio.subprocess.Process | None = None  # the one taking requests; None until started
        self.pending: dict[int, tuple[asyncio.subprocess.Process, asyncio.Future]] = {}
        self.cancels: dict[int, tuple[asyncio.subprocess.Process, asyncio.Future]] = {}
        self.ids = itertools.count(1)
        self.started = asyncio.Lock()
        self.stderr_tails: dict[asyncio.subprocess.Process, bytes] = {}  # the last 4 kB each process wrote
        self.readers: set[asyncio.Task] = set()  # each process's stdout and stderr readers (a task needs a reference)
        self.watchdogs: set[asyncio.Task] = set()  # waiting for cancellations to be confirmed

    async def request(self, message: dict[str, Any], timeout_s: float | None, what: str) -> Any:
        """Send ``message`` and return its answer's result (AgentProcessError, naming ``what``, for its error); a
        timeout or a cancellation cancels it in the host."""
        process = await self._start()
        assert process.stdin is not None
        rid = next(self.ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[rid] = (process, future)
        process.stdin.write(json.dumps({**message, "id": rid}).encode() + b"\n")
        try:
            with contextlib.suppress(ConnectionError):  # a dead host: its reader fails the future, with why
                await process.stdin.drain()
            answer = await asyncio.wait_for(future, timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self._cancel(rid, process)
            raise
        finally:
            self.pending.pop(rid, None)
        if "error" in answer:
            raise AgentProcessError(f"{what}: {answer['error']}")
        return answer["result"]

    def _cancel(self, rid: int, process: asyncio.subprocess.Process) -> None:
        if process.returncode is not None or process.stdin is None or process.stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError):
            process.stdin.write(json.dumps({"op": "cancel", "id": rid}).encode() + b"\n")
        ack = asyncio.get_running_loop().create_future()
        self.cancels[rid] = (process, ack)
        self._keep(self.watchdogs, self._expect(ack, rid, process))

    async def _expect(self, ack: asyncio.Future, rid: int, process: asyncio.subprocess.Process) -> None:
        try:
            await asyncio.wait_for(ack, CANCEL_ACK_S)
        except TimeoutError:
            if process.returncode is None:
                self._retire(process)  # before it is reaped: requests from now on must not reach it
                self._note(process, f"\n[{self.name} did not confirm a cancellation in {CANCEL_ACK_S:g} s: "
                                    "its event loop is blocked; killed]".encode())
                process.kill()
        finally:
            self.cancels.pop(rid, None)

    def _retire(self, process: asyncio.subprocess.Process) -> None:
        if self.process is process:
            self.process = None

    async def _start(self) -> asyncio.subprocess.Process:
        async with self.started:
            if self.process is not None and self.process.returncode is None:
                return self.process
            # the host ends when its stdin closes: when this process exits, however it exits
            process = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, limit=1 << 26,
                env=self.env)
            stderr = self._keep(self.readers, self._drain_stderr(process))
            try:
                ready = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)  # type: ignore[union-attr]
            except TimeoutError:
                process.kill()
                raise AgentProcessError(f"{self.name} did not start in {START_TIMEOUT_S:g} s") from None
            if not ready:
                await process.wait()
                await asyncio.wait({stderr}, timeout=STDERR_AFTER_EXIT_S)
                raise AgentProcessError(f"{self.name} exited {process.returncode} while starting: "
                                        f"{self._tail(process)}")
            self._keep(self.readers, self._read(process, stderr))
            self.process = process
            return process

    @staticmethod
    def _keep(tasks: set[asyncio.Task], work: Any) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def _drain_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.read(1 << 16):
            self._note(process, chunk)

    def _note(self, process: asyncio.subprocess.Process, text: bytes) -> None:
        self.stderr_tails[process] = (self.stderr_tails.get(process, b"") + text)[-4000:]

    def _tail(self, process: asyncio.subprocess.Process) -> str:
        return self.stderr_tails.pop(process, b"").decode(errors="replace")[-1000:]

    async def _read(self, process: asyncio.subprocess.Process, stderr: asyncio.Task) -> None:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            try:
                answer = json.loads(line)
            except ValueError:  # not an answer: skipped, so that the reader goes on
                continue
            waiting = self.cancels if answer.get("cancelled") else self.pending
            sent_to, future = waiting.get(answer.get("id"), (None, None))
            if sent_to is process and not future.done():  # a host answers only what was sent to it
                future.set_result(answer)
        self._retire(process)  # its stdout is closed: it is exiting, whether or not it has been reaped yet
        await process.wait()
        await asyncio.wait({stderr}, timeout=STDERR_AFTER_EXIT_S)
        error = AgentProcessError(f"{self.name} exited {process.returncode}: {self._tail(process)}")
        for sent_to, future in self.pending.values():
            if sent_to is process and not future.done():
                future.set_exception(error)


_hosts: dict[tuple, HostProcess] = {}


def host_process(argv: list[str], name: str, env: dict[str, str] | None = None) -> HostProcess:
    """The host process running ``argv`` for the running event loop (a process's streams belong to the loop that
    made them)."""
    key = (tuple(argv), asyncio.get_running_loop())
    host = _hosts.get(key)
    if host is None:
        for stale in [k for k in _hosts if k[1].is_closed()]:
            del _hosts[stale]
        host = _hosts[key] = HostProcess(argv, name, env)
    return host


def agent_ref(agent: Callable[..., Any]) -> str:
    """Where a host process finds ``agent``: ``module:qualname``, or ``script.py:qualname`` for a script's."""
    module, qualname = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if module is None or not qualname or "<" in qualname:
        raise ValueError(f"agent_process=True runs the agent in another process, which finds it by name: {agent!r} "
                         "is not a module-level function or class (a lambda, a closure, a bound method or a "
                         "partial cannot be found there)")
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if script is None:
            raise ValueError(f"agent_process=True cannot find {qualname!r} from another process: it was defined "
                             "interactively; define it in a module")
        return f"{Path(script).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def load_agent(ref: str) -> Any:
    """The object ``ref`` (from :func:`agent_ref`) names; a script is run as a module that is not ``__main__``, so
    its ``if __name__ == "__main__":`` block does not run."""
    where, _, qualname = ref.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("__envkit_agent_main__", where)
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = script
        spec.loader.exec_module(script)
        ref = f"{spec.name}:{qualname}"
    return import_ref(ref)


@dataclass(frozen=True)
class HostedAgent:
    """The agent ``ref`` (see :func:`agent_ref`), run in this event loop's host process for it, started with this
    process's ``sys.path`` so that it imports what this process does."""

    ref: str

    async def __call__(self, task: Task, client: AgentClient) -> Any:
        """Run one episode in the host; raises :class:`~envkit.errors.AgentProcessError` if the agent raised or
        the host died."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        argv = [sys.executable, "-m", "envkit.agents.host", self.ref]
        host = host_process(argv, f"the agent host process of {self.ref!r}", env)
        return await host.request({"op": "run", "task": task, "client": asdict(client)}, None,
                                  f"the agent of task {task.get('id')!r} failed")
