"""A model server subprocess we own: free port, log file, health wait, crash detection, clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import httpx

from generators.engines.base import EngineError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGKILL it when its parent dies, even by SIGKILL, so a
    killed trainer never leaves a model server holding memory and a port."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ManagedServer:
    """Runs ``command(port)`` in its own process group, logs to ``log_path``, and waits on ``health_path``.

    The whole process group is killed on stop, so helper processes a server forks (vLLM's engine core) go too;
    a finalizer does the same if the owner forgets to stop it.
    """

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        health_path: str = "/health",
        startup_timeout: float = 600.0,
    ) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        self.env = env or {}
        self.host = host
        self.requested_port = port
        self.port = port or 0
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.process: asyncio.subprocess.Process | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        """True while the server process is running."""
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Launch the server and wait until its health route answers 200; raises EngineError with the log tail."""
        if self.alive:
            return
        self.port = self.requested_port or free_port(self.host)
        argv = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s on port %d: %s (log: %s)", self.name, self.port, " ".join(argv), self.log_path)
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n==== {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
            log_file.flush()
            self.process = await asyncio.create_subprocess_exec(
                *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True, preexec_fn=_die_with_parent,
            )
        self._finalizer = weakref.finalize(self, _kill_group, self.process.pid, signal.SIGKILL)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not self.alive:
                    raise EngineError(f"{self.name} exited with code {self.process.returncode} while starting.\n"
                                      f"Last log lines ({self.log_path}):\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.base_url + self.health_path)).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise EngineError(f"{self.name} did not become healthy within {self.startup_timeout:.0f} s.\n"
                          f"Last log lines ({self.log_path}):\n{self.log_tail()}")

    async def exited_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the process to exit; True if it is not running."""
        if self.process is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), seconds)
        except TimeoutError:
            return False
        return True

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` seconds; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            _kill_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
        # Children (e.g. vLLM's engine core) can outlive the leader; the group kill reaches them.
        _kill_group(process.pid, signal.SIGKILL)
        await process.wait()
        if self._finalizer is not None:
            self._finalizer.detach()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
